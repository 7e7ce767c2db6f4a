"""`specdec bench`: ours vs plain HF generate vs HF prompt lookup, one process, same prompts.

For every question (first turn, chat template applied) each method generates greedily; the order
of methods rotates from question to question so machine noise hits all of them alike, and every
output is compared token for token with HF generate's. With ``--temperature T > 0`` every method
samples instead (HF generate with ``do_sample=True``, ours losslessly, from the same processed
distribution; HF's prompt lookup is left out), outputs are not compared (``identical`` is None)
and speedup and tau are reported as before. Figures are ratios taken in this run:
    speedup      Spec-Bench's formula: the method's tokens/s over HF generate's (totals)
    median       the median over questions of HF time / method time (robust to outliers)
    tau          mean tokens per target forward (accepted drafts + 1), where the method reports it
Per-question records are appended to ``--out``.jsonl as they finish.

Sessions: each drafter is built once and reused for every question (``begin`` resets it, as in
``specdec specbench``). A drafter with a corpus (``suffix-corpus``) first drops any stored answer to a
benchmark question (``--suffix-exclude-questions``, on by default); ``--remember`` adds every answer
of the session to the corpus of the drafters that can remember (outside the timed generation), and
``--repeat 2`` asks the same questions twice in one session (remembering): the second pass's speedup
is what a repeated workload gains. Records carry their ``pass`` (1-based).

Peers: ``--peer llama.cpp`` runs another engine in its own process before and after the timed block,
on the target's GGUF file and the same prompt ids; its rows ("llama.cpp plain (before)", ...) are
compared with HF generate's outputs of this run (``specdec.bench.peers``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.peers import PEERS, PeerSession, peer_setup
from specdec.bench.runner import AnswerFile, group, make_decoder, rotated, warm_up
from specdec.arguments import MODEL_DTYPES, int_list, name_list, non_negative_float, positive_int
from specdec.prompting import chat_ids, eos_ids, user_turn
from specdec.runtime import kernels
from specdec.drafters.base import Corpus
from specdec.sampling import sampling_kwargs

HF_PROMPT_LOOKUP_TOKENS = 10  # HF's documented default for prompt_lookup_num_tokens


@dataclass
class Method:
    name: str
    run: object  # (ids [1, P], max_new_tokens) -> (sequences [1, P + n], steps or None)
    remember: object = None  # (sequences [1, P + n], P) -> None: the drafter keeps the answer, if it can
    # the method whose output this one's must equal (None: the first, HF generate); a target in int8
    # numerics is its own reference: its methods are compared with its plain decoding
    reference: str | None = None


def hf_methods(model, eos, temperature: float = 0.0) -> list[Method]:
    """HF generate, and (greedy only) HF's prompt lookup."""
    sampling = sampling_kwargs(model, temperature)
    pad = eos[0] if isinstance(eos, list) else eos  # one sequence: pads nothing, stops HF's warning

    def plain(ids, n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, eos_token_id=eos,
                              pad_token_id=pad, **sampling), None

    def lookup(ids, n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad,
                              prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS), None

    return [Method("hf-generate", plain)] + ([Method("hf-prompt-lookup", lookup)] if not temperature else [])


def specdec_method(model, drafter_name: str, eos, temperature: float = 0.0, prepare=None) -> Method:
    """One drafter for the whole session (begin() resets it); ``prepare(drafter)`` runs once first."""
    sampling = sampling_kwargs(model, temperature)
    decoder = make_decoder(model, drafter_name, prepare)
    drafter = decoder.drafter

    def go(ids, n):
        out = decoder.generate(ids, max_new_tokens=n, eos_token_id=eos, **sampling)
        return out.sequences, len(out.steps)

    remember = None
    if isinstance(drafter, Corpus):  # corpus drafters (suffix, auto): keep the session's answers
        def remember(seq, prompt_len):
            drafter.remember(seq[0].tolist(), prompt_len)

    return Method(f"specdec:{drafter_name}", go, remember)


def prepare_corpus_drafter(drafter, questions, tokenizer, exclude: bool, corpus_file: str | None,
                           say=print) -> None:
    """Before the session: drop stored answers to the benchmark's questions (matched on the decoded
    prompt text), add ``--corpus FILE``, and index the corpus (so no timed generation pays for it)."""
    if not isinstance(drafter, Corpus):
        return
    if corpus_file:
        from specdec.drafters.suffix import read_corpus

        drafter.add_documents(read_corpus(corpus_file, tokenizer))
    if exclude:
        turns = [t for q in questions for t in q.turns]
        dropped = drafter.exclude_questions(turns, tokenizer.decode)
        say(f"{type(drafter).__name__}: {dropped} corpus conversation(s) answering a benchmark question dropped")
    drafter.build_index()


def run_bench(model, tokenizer, questions, methods: list[Method], max_new_tokens: int, log_path: Path | None,
              progress=None, passes: int = 1, remember: bool = False, compare: bool = True,
              answers_path: Path | None = None, answers: list | None = None) -> list[dict]:
    """One record per (pass, question, method): tokens, seconds, steps, identical-to-HF (None when
    not ``compare``: sampled outputs differ by design). With ``remember``, each answer goes to its
    method's drafter after its timed run (``Method.remember``). ``answers_path``: the first method's
    output of each question in the first pass, as a token-id JSONL (``prompt_len``, ``ids``; what
    ``python -m specdec.bench.replay --answers`` reads); ``answers``: a list that receives the same
    records (a peer's replies are compared with them)."""
    log = None if log_path is None else AnswerFile(log_path, key=("pass", "question_id", "method"), fresh=True)
    sinks = [s for s in (None if answers_path is None else AnswerFile(answers_path, fresh=True), answers)
             if s is not None]
    warm = tokenizer("Hello", return_tensors="pt")["input_ids"]
    warm_up(methods, lambda m: m.run(warm, 4))
    records = []
    for p in range(1, passes + 1):
        for qi, q in enumerate(questions):
            new = _run_question(p, qi, q, tokenizer, methods, max_new_tokens, remember, compare,
                                sinks if p == 1 else [])
            for rec in new:
                if log is not None:
                    log.append(rec)
            records += new
            if progress is not None:
                progress()
    return records


def _run_question(p, qi, q, tokenizer, methods, max_new_tokens, remember, compare, answers) -> list[dict]:
    """Every method on question ``q``'s first turn, in the order rotated for the qi-th question; the
    first method's output goes to each of ``answers``."""
    ids = chat_ids(tokenizer, user_turn(q.turns[0]))
    outs = {}
    for m in rotated(methods, qi):
        t = time.perf_counter()
        seq, steps = m.run(ids, max_new_tokens)
        dt = time.perf_counter() - t
        outs[m.name] = (seq, steps, dt)
        if remember and m.remember is not None:
            m.remember(seq, ids.shape[1])
    ref = outs[methods[0].name][0]
    for sink in answers:
        sink.append({"question_id": q.question_id, "category": q.category, "prompt_len": ids.shape[1],
                     "ids": ref[0].tolist()})
    records = []
    for m in methods:
        seq, steps, dt = outs[m.name]
        records.append({"pass": p, "question_id": q.question_id, "category": q.category, "method": m.name,
                        "new_tokens": seq.shape[1] - ids.shape[1], "seconds": dt, "steps": steps,
                        "identical": bool(torch.equal(seq, outs[m.reference or methods[0].name][0]))
                        if compare else None})
    return records


def _method_stats(recs: list[dict], baseline: str) -> dict:
    """Per method over ``recs``: tokens/s, speedup over the baseline's, median speedup, tau, identical."""
    by = group(recs, lambda r: r["method"])
    base = by[baseline]
    base_tps = sum(r["new_tokens"] for r in base) / sum(r["seconds"] for r in base)
    base_time = {r["question_id"]: r["seconds"] for r in base}
    out = {}
    for name, rs in by.items():
        tokens, secs = sum(r["new_tokens"] for r in rs), sum(r["seconds"] for r in rs)
        steps = [r["steps"] for r in rs if r["steps"] is not None]
        out[name] = {
            "questions": len(rs), "tokens": tokens, "tokens_per_s": tokens / secs,
            "speedup": tokens / secs / base_tps,
            "median_speedup": statistics.median(base_time[r["question_id"]] / r["seconds"] for r in rs),
            "tau": tokens / sum(steps) if len(steps) == len(rs) else None,
            "identical": None if any(r["identical"] is None for r in rs) else sum(r["identical"] for r in rs),
        }
    return out


def summarize(records: list[dict], baseline: str, group_of) -> dict:
    """Per method (and per group of categories): tokens/s, speedup over baseline, tau, identical."""
    groups = group(records, lambda r: group_of(r["category"]))
    return {"overall": _method_stats(records, baseline),
            "by_task": {g: _method_stats(rs, baseline) for g, rs in sorted(groups.items())}}


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: the shipped set)")
    p.add_argument("--per-category", type=positive_int, default=2, help="questions per category")
    p.add_argument("--categories", type=name_list, default=None, help="comma-separated categories (default: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--drafters", type=name_list, default=name_list("none,prompt-lookup"),
                   help="comma-separated registry names")
    p.add_argument("--no-hf-lookup", action="store_true", help="skip HF's prompt-lookup method")
    p.add_argument("--batch-size", type=int_list, default=None,
                   help="batched throughput instead: comma-separated batch sizes (e.g. 1,2,4,8,16); batched HF "
                        "generate vs specdec per size, total tokens/s and first/last/mean finish times "
                        "(specdec.bench.batch)")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="with --batch-size: runs per method and size (medians)")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="ask the questions this many times in one session, drafters remembering their answers "
                        "(the repeated-use scenario; the summary reports each pass)")
    p.add_argument("--remember", action="store_true",
                   help="drafters that can (suffix) add each answer of the session to their corpus")
    p.add_argument("--corpus", default=None,
                   help="earlier generations for the suffix drafters: a .jsonl of token ids "
                        "(data/eagle_answers.jsonl's format) or plain text, one document per line")
    p.add_argument("--suffix-exclude-questions", action=argparse.BooleanOptionalAction, default=True,
                   help="drop corpus conversations whose prompt holds a benchmark question (default: on)")
    p.add_argument("--out", default="results/bench", help="writes OUT.jsonl (records) and OUT.json (summary)")
    p.add_argument("--save-answers", default=None, metavar="FILE",
                   help="write HF generate's output of each question as token ids (JSONL), for "
                        "`python -m specdec.bench.replay --answers FILE`")
    p.add_argument("--packed-drafters", default="", metavar="NAMES",
                   help="also these drafters on the same model loaded with --weights (a GGUF's blocks kept "
                        "packed, or quantized on load), as methods named packed:NAME in the same rotation")
    p.add_argument("--weights", default="packed", help="the second target's weights (with --packed-drafters)")
    p.add_argument("--int8-drafters", default="", metavar="NAMES",
                   help="also these drafters on the model loaded with --weights in int8 numerics (quant.numerics), "
                        "as methods named int8:NAME, each compared with int8:none (which runs too: that target's "
                        "own plain decoding)")
    p.add_argument("--dtype", default="float32", choices=sorted(MODEL_DTYPES),
                   help="the target's dtype, HF generate's too (the --packed-drafters target computes in float32); "
                        "a bfloat16 target is not token-exact: docs/benchmarks.md, quantized weights")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (default): greedy, outputs compared token for token with HF's; > 0: every "
                        "method samples (HF generate with do_sample=True and HF's other defaults, "
                        "e.g. top_k 50; no HF prompt lookup), outputs not compared, tau and speedup reported")
    p.add_argument("--peer", default=None, metavar="NAME",
                   help=f"also run another engine ({', '.join(PEERS)}) in its own process before and after "
                        "specdec's timed block, on the target's GGUF file and the same prompt ids (greedy); its "
                        "rows join the table (specdec.bench.peers)")
    p.add_argument("--peer-python", default=None, metavar="PATH",
                   help="the interpreter that runs the peer (it needs the peer's package, e.g. llama-cpp-python; "
                        "default: this one)")


def run(args) -> int:
    peer = None if args.peer is None else peer_setup(args.peer, args.peer_python, args.model, args.temperature,
                                                     args.repeat, args.batch_size)  # before any model loads
    if args.batch_size:
        from specdec.bench import batch

        return batch.run(args)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from specdec.models import load_model
    from specdec.bench.questions import load_questions, select_questions

    console = Console()
    questions = load_questions(args.questions) if args.questions else load_questions()
    questions = select_questions(questions, categories=args.categories or None, limit_per_category=args.per_category)
    loaded = load_model(args.model, dtype=MODEL_DTYPES[args.dtype], weights="fp32")
    model, tok = loaded.model, loaded.tokenizer
    kernels.prepare()  # the kernel build and route self-check happen before any timed run
    eos = eos_ids(model) or None
    methods = _methods(args, model, tok, eos, questions, console)
    out = Path(args.out)
    remember = args.remember or args.repeat > 1
    session = None if peer is None else PeerSession(peer, _peer_request(questions, tok, eos, args), console.print)
    hf_answers = []  # HF generate's output of each question: what a peer's replies are compared with
    if session is not None:
        session.run("before")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("bench", total=len(questions) * args.repeat)
        records = run_bench(model, tok, questions, methods, args.max_new_tokens, out.with_suffix(".jsonl"),
                            progress=lambda: bar.advance(task), passes=args.repeat, remember=remember,
                            compare=not args.temperature,
                            answers_path=Path(args.save_answers) if args.save_answers else None,
                            answers=hf_answers)
    if session is not None:
        session.run("after")
        records += _peer_records(session, questions, hf_answers, out.with_suffix(".jsonl"))
    summary = _summary(args, records, methods[0].name, loaded.name, remember, session)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print_tables(console, summary, f"{loaded.name}, {len(questions)} questions, {args.max_new_tokens} new tokens, "
                 + ("greedy" if not args.temperature else f"sampling at temperature {args.temperature}"))
    if session is not None:
        console.print(session.note())
    return 0


def _methods(args, model, tokenizer, eos, questions, console) -> list[Method]:
    """What the bench times, in rotation: HF generate (and, greedy, its prompt lookup unless --no-hf-lookup), then
    each drafter on the model, then those of ``--packed-drafters`` and ``--int8-drafters`` on the same
    model at other weights or in int8 numerics."""
    from specdec.models import load_model

    methods = hf_methods(model, eos, args.temperature)
    if args.no_hf_lookup:
        methods = methods[:1]

    def prepare(drafter):
        prepare_corpus_drafter(drafter, questions, tokenizer, args.suffix_exclude_questions, args.corpus,
                               console.print)

    methods += [specdec_method(model, d, eos, args.temperature, prepare) for d in args.drafters]
    if args.packed_drafters:  # the same model at other weights, in the same rotation
        packed = load_model(args.model, weights=args.weights).model
        for d in args.packed_drafters.split(","):
            method = specdec_method(packed, d, eos, args.temperature, prepare)
            methods.append(dataclasses.replace(method, name=f"packed:{d}"))
    if args.int8_drafters:  # the same model in int8 numerics: its own reference, its plain decoding
        int8 = load_model(args.model, weights=args.weights, numerics="int8").model
        names = ["none", *(d for d in args.int8_drafters.split(",") if d != "none")]
        for d in names:
            method = specdec_method(int8, d, eos, args.temperature, prepare)
            methods.append(dataclasses.replace(method, name=f"int8:{d}", reference="int8:none"))
    return methods


def _summary(args, records: list[dict], baseline: str, model_name: str, remember: bool, session) -> dict:
    """summarize() of the first pass (and of each pass with --repeat), and the run's settings."""
    from specdec.bench.questions import task_of

    summary = summarize([r for r in records if r["pass"] == 1], baseline, task_of)
    if args.repeat > 1:
        summary["passes"] = {p: summarize([r for r in records if r["pass"] == p], baseline, task_of)
                             for p in range(1, args.repeat + 1)}
    summary["meta"] = {"model": model_name, "questions": args.questions or "shipped", "per_category":
                       args.per_category, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                       "threads": torch.get_num_threads(), "dtype": args.dtype, "kernel_routes": list(kernels.routes()),
                       "torch": torch.__version__, "machine": platform.machine(), "repeat": args.repeat,
                       "remember": remember, "suffix_exclude_questions": args.suffix_exclude_questions,
                       "corpus": args.corpus, "date": time.strftime("%Y-%m-%d")}
    if session is not None:
        summary["meta"]["peer"] = session.meta()
    return summary


def _peer_request(questions, tokenizer, eos, args) -> dict:
    """What a peer runs: the bench's own prompt ids (``_run_question``'s), EOS ids, budget, threads."""
    prompts = [chat_ids(tokenizer, user_turn(q.turns[0]))[0].tolist() for q in questions]
    return {"prompts": prompts, "eos": list(eos or []), "max_new_tokens": args.max_new_tokens,
            "threads": torch.get_num_threads(), "lookup_tokens": HF_PROMPT_LOOKUP_TOKENS}


def _peer_records(session, questions, hf_answers: list[dict], log_path: Path) -> list[dict]:
    """The peer's records, compared with HF generate's new tokens, also appended to the bench's log."""
    reference = {a["question_id"]: a["ids"][a["prompt_len"]:] for a in hf_answers}
    records = session.records([q.question_id for q in questions], [q.category for q in questions], reference)
    log = AnswerFile(log_path, key=("pass", "question_id", "method"))
    for rec in records:
        log.append(rec)
    return records


def print_tables(console, summary: dict, title: str) -> None:
    """The overall table, speedups per task, and (with passes) each pass's speedup and tau."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("method", "tokens/s", "speedup", "median speedup", "tau", "identical"):
        table.add_column(col, justify="right")
    for name, s in summary["overall"].items():
        table.add_row(name, f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x", f"{s['median_speedup']:.2f}x",
                      "-" if s["tau"] is None else f"{s['tau']:.2f}",
                      "-" if s["identical"] is None else f"{s['identical']}/{s['questions']}")
    console.print(table)
    by_task = Table(title="speedup over hf-generate per Spec-Bench task")
    by_task.add_column("task")
    names = list(summary["overall"])
    for n in names:
        by_task.add_column(n, justify="right")
    for g, st in summary["by_task"].items():
        by_task.add_row(g, *(f"{st[n]['speedup']:.2f}x" for n in names))
    console.print(by_task)
    if "passes" not in summary:
        return
    passes = Table(title="repeated use: the same questions again in one session (drafters remembering)")
    passes.add_column("method")
    for p in summary["passes"]:
        passes.add_column(f"pass {p} speedup", justify="right")
        passes.add_column(f"pass {p} tau", justify="right")
    for n in names:
        cells = []
        for st in summary["passes"].values():
            s = st["overall"][n]
            cells += [f"{s['speedup']:.2f}x", "-" if s["tau"] is None else f"{s['tau']:.2f}"]
        passes.add_row(n, *cells)
    console.print(passes)
