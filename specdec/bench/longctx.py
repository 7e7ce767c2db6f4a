"""`specdec bench-longctx`: self-speculation at long contexts (MagicDec) against HF generate.

Prompts are book excerpts (``/work/shared/longctx/books.jsonl`` or ``--questions`` in that format)
cut to the first N tokens (``--lengths``), followed by an instruction ("Continue the story." or
"Summarize the passage above."), inside the chat template. For each prompt every method generates
greedily, in an order rotated from prompt to prompt so machine noise hits all alike, and every
output is compared token for token with HF generate's. Methods: HF ``generate``, specdec plain
decoding (``none``), ``streaming`` and ``snapkv`` at each ``--budgets`` size, ``prompt-lookup``.

``--batch-size B`` (MagicDec's regime: a batch's KV reads outgrow its weight reads): a prompt is then
B excerpts of one length, B different books, run as one batch (HF ``generate`` with left padding,
specdec with a list of prompts); rows are compared with HF's batched rows, tokens/s counts every row.

Per record (one prompt, one method), appended to ``--out``.jsonl as it finishes (a rerun skips the
records already there):
    tokens_per_s, ttft     end to end (all rows); TTFT = until the first new token of the run (HF:
                           its first logits processor call; specdec: its first step, prefill + the
                           drafter's setup)
    accept_rate            drafted tokens accepted / drafted; gamma = mean draft forwards per drafting
                           step (at a batch: the longest row's draft)
    alpha                  per-token acceptance as the cost model uses it (a rejection ends a trial)
    t_target, t_draft,     seconds: a plain decode step (``none`` on the same prompt), one draft
    t_verify               forward (for the whole batch), one verify forward of gamma + 1 rows per
                           sequence (this method's steps)
    predicted              MagicDec's speedup from those (not for ``auto``, whose steps mix drafters),
                           next to measured = decode-phase tokens/s over ``none``'s decode-phase
                           tokens/s on the same prompt
``--memory`` also runs each method once in a child process at the longest prompt and records its
peak RSS above the loaded model (Linux: /proc/self/clear_refs resets the peak after loading).
"""

from __future__ import annotations

import json
import queue
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.bench.books import BOOKS, INSTRUCTIONS, LongPrompt, build_prompts, read_books
from specdec.bench.runner import AnswerFile, group, rotated, warm_up
from specdec.arguments import add_numerics_argument, int_list, name_list, positive_int
from specdec.config import RuntimeConfig, use
from specdec.config import current as current_runtime
from specdec.controller import cost
from specdec.prompting import context_window


@dataclass(frozen=True)
class MethodSpec:
    name: str  # "hf-generate", "none", "streaming@512", "snapkv@512", "prompt-lookup", "streaming@512@k=3"
    drafter: str | None  # registry name; None = HF generate
    budget: int | None = None  # KV rows of a self-speculation drafter
    fixed: str = ""  # "k=N" / "n=N": a fixed draft length / tree size instead of the controller


def make_methods(names: list[str], budgets: list[int]) -> list[MethodSpec]:
    """``NAME@k=N`` / ``NAME@n=N`` is NAME at a fixed setting (specdec.bench.runner.fixed_setting);
    streaming and snapkv expand to one method per budget: "streaming@k=3" -> "streaming@256@k=3", ..."""
    methods = []
    for full in names:
        name, _, fixed = full.partition("@")
        tail = f"@{fixed}" if fixed else ""
        if name == "hf-generate":
            methods.append(MethodSpec(name, None))
        elif name in ("streaming", "snapkv"):
            methods += [MethodSpec(f"{name}@{b}{tail}", name, b, fixed) for b in budgets]
        else:
            methods.append(MethodSpec(full, name, None, fixed))
    return methods


def make_drafter(spec: MethodSpec, model):
    from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
    from specdec.drafters.vocab import packaged_vocabulary
    from specdec.registry import make_drafter as by_name

    if spec.budget is None:
        return by_name(spec.drafter, model)
    # as the registry's: over the packaged draft vocabulary where it fits the target
    return {"streaming": StreamingDrafter, "snapkv": SnapKVDrafter}[spec.drafter](
        model, budget=spec.budget, vocab=packaged_vocabulary(model))


def step_figures(steps) -> dict:
    """Acceptance and timings from a generation's StepStats (step 0, the prefill, left out). At a
    batch a drafting step is one where any row drafted; its draft forwards are the longest row's
    draft (a chain drafter runs the whole batch once per token), acceptance counts every row."""
    decode = steps[1:]
    drafting = [s for s in decode if max(s.num_drafted)]
    plain = [s for s in decode if not max(s.num_drafted)]
    forwards = sum(max(s.num_drafted) for s in drafting)
    drafted = sum(sum(s.num_drafted) for s in drafting)
    accepted = sum(sum(s.num_accepted) for s in drafting)
    trials = sum(a + (a < d) for s in drafting for d, a in zip(s.num_drafted, s.num_accepted) if d)
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {
        "drafting_steps": len(drafting), "plain_steps": len(plain),
        "accept_rate": accepted / drafted if drafted else None,
        "alpha": accepted / trials if trials else None,
        "gamma": forwards / len(drafting) if drafting else 0.0,
        "t_draft": sum(s.draft_time for s in drafting) / forwards if forwards else None,
        "t_verify": mean([s.verify_time for s in drafting]),
        "t_plain": mean([s.verify_time for s in plain]),
        "decode_seconds": sum(s.draft_time + s.verify_time for s in decode),
    }


def predicted_speedup(fig: dict, t_target: float | None) -> float | None:
    """MagicDec's estimate for this run's mean gamma and alpha (1.0 when it never drafted)."""
    if not fig["drafting_steps"]:
        return 1.0
    if t_target is None or fig["alpha"] is None:
        return None
    g = fig["gamma"]  # Omega's closed form holds for a mean gamma too (an estimate, not a count)
    return cost.omega(g, fig["alpha"]) * t_target / (g * fig["t_draft"] + fig["t_verify"])


class _FirstCall(LogitsProcessor):
    """Records when HF generate first processes logits: its prefill is done (TTFT)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        self.at = self.at or time.perf_counter()
        return scores


def run_method(spec: MethodSpec, model, rows: tuple[torch.Tensor, ...], max_new_tokens: int, eos) -> dict:
    """One generation of the batch ``rows`` ([B] of [P_b]): each row's new tokens (up to its EOS),
    seconds, TTFT and (specdec) step figures."""
    from specdec.bench.batch import left_padded, until_eos
    from specdec.decoder import SpecDecoder

    eos_list = [eos] if isinstance(eos, int) else list(eos or [])
    if spec.drafter is None:
        pad = eos_list[0] if eos_list else 0
        ids, mask = left_padded(list(rows), pad)  # one row: no padding
        first = _FirstCall()
        t = time.perf_counter()
        seq = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad, logits_processor=LogitsProcessorList([first]))
        seconds = time.perf_counter() - t
        return {"outputs": [until_eos(r, eos_list) for r in seq[:, ids.shape[1]:].tolist()], "seconds": seconds,
                "ttft": first.at - t}
    from specdec.bench.runner import fixed_setting
    from specdec.decoder import SpecDecoderConfig

    drafter = make_drafter(spec, model) if spec.drafter != "none" else None
    decoder = SpecDecoder(model, drafter, fixed_setting(spec.fixed) if spec.fixed else SpecDecoderConfig())
    decoder.warm_up()  # a corpus (suffix-corpus, auto) is indexed before the clock, as a session's is once
    first_step: list[float] = []
    t = time.perf_counter()
    out = decoder.generate(
        list(rows) if len(rows) > 1 else rows[0][None], max_new_tokens=max_new_tokens, eos_token_id=eos,
        callback=lambda e: first_step or first_step.append(time.perf_counter()))
    seconds = time.perf_counter() - t
    return {"outputs": [out.generated(b).tolist() for b in range(len(rows))], "seconds": seconds,
            "ttft": first_step[0] - t, "steps": len(out.steps), **step_figures(out.steps)}


def finish_records(prompt: LongPrompt, results: dict[str, dict], reference: str = "hf-generate") -> list[dict]:
    """Ratios within one prompt: to HF generate, and the cost model against ``none``'s decode; ``identical``:
    rows equal to ``reference``'s (HF generate; ``none`` for a target in int8 numerics, its own reference)."""
    B = len(prompt.rows)
    new = lambda r: sum(len(o) for o in r["outputs"])  # noqa: E731  tokens of every row
    # the decode phase: every row's first token comes from the prefill step
    decode_rate = lambda r: (new(r) - B) / r["decode_seconds"] if r.get("decode_seconds") else None  # noqa: E731
    hf = results.get("hf-generate")
    ref = results.get(reference)
    plain = results.get("none")
    t_target = plain.get("t_plain") if plain else None
    plain_rate = decode_rate(plain) if plain else None
    records = []
    for name, r in results.items():
        rec = {"prompt": prompt.key, "book": prompt.books[0], "batch": B, "length": prompt.length,
               "instruction": prompt.instruction, "prompt_tokens": prompt.tokens, "method": name,
               **{k: v for k, v in r.items() if k != "outputs"},
               "new_tokens": new(r), "tokens_per_s": new(r) / r["seconds"]}
        if ref is not None:
            rec["identical"] = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))  # rows equal to the reference's
        if hf is not None:
            rec["hf_tokens_per_s"] = new(hf) / hf["seconds"]
            rec["speedup_vs_hf"] = rec["tokens_per_s"] / rec["hf_tokens_per_s"]
        if "steps" in r and name != "hf-generate":
            # one drafter's figures; ``auto`` mixes classes (free copies, StreamingLLM's forwards) in
            # one mean draft time and alpha, for which the formula has no meaning (at 8 x 7k it gave
            # 1.63 where auto measured 1.10, and a traced rerun 1.03x streaming's decode phase)
            rec["predicted"] = None if name.partition("@")[0] == "auto" else predicted_speedup(r, t_target)
            rate = decode_rate(r)
            rec["measured"] = rate / plain_rate if rate and plain_rate else None
        rec["outputs"] = r["outputs"]  # kept so a resumed run can still compare with HF's outputs
        records.append(rec)
    return records


def _peak_rss_child(spec: MethodSpec, model_spec: str, ids: list[int], max_new_tokens: int, out,
                    runtime: RuntimeConfig, weights: str = "fp32", numerics: str = "exact") -> None:
    with use(runtime):  # a spawned process: the parent's runtime, handed over
        _peak_rss(spec, model_spec, ids, max_new_tokens, out, runtime.bench_threads, weights, numerics)


def _peak_rss(spec: MethodSpec, model_spec: str, ids: list[int], max_new_tokens: int, out, threads: int,
              weights: str = "fp32", numerics: str = "exact") -> None:
    torch.set_num_threads(threads)
    from specdec.models import load_model

    loaded = load_model(model_spec, weights=weights, numerics=numerics)
    x = torch.tensor([ids])
    with warnings.catch_warnings():  # warm-up: one-off allocations are not the method's
        warnings.simplefilter("ignore")  # (its short prompt fits every budget)
        run_method(spec, loaded.model, (x[0, :64],), 4, None)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS

    def kib(field):
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field))
        return int(line.split()[1])

    base = kib("VmRSS:")
    with torch.inference_mode():
        run_method(spec, loaded.model, (x[0],), max_new_tokens, loaded.model.generation_config.eos_token_id)
    out.put((kib("VmHWM:") - base) / 1024)


def peak_rss_mb(spec: MethodSpec, model_spec: str, ids: torch.Tensor, max_new_tokens: int, weights: str = "fp32",
                numerics: str = "exact") -> float:
    """Peak RSS (MB) one generation adds above the loaded model, measured in a fresh process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_rss_child, args=(spec, model_spec, ids[0].tolist(), max_new_tokens, q,
                                                      current_runtime(), weights, numerics))
    p.start()
    while True:  # a child that dies (out of memory, an error) must not hang the bench
        try:
            value = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"--memory: the child running {spec.name} exited with code {p.exitcode}")
    p.join()
    return value


def add_prompt_arguments(p, lengths: str, max_new_tokens: int) -> None:
    """The book prompts' options (also ``bench-controller``'s): model, excerpts, lengths, instruction."""
    p.add_argument("--model", default="default")
    p.add_argument("--questions", default=None, help=f"excerpts, JSONL of {{id, text}} (default: {BOOKS})")
    p.add_argument("--books", type=positive_int, default=2, help="first N excerpts of the file")
    p.add_argument("--lengths", type=int_list, default=lengths, help="excerpt tokens kept, from the start")
    p.add_argument("--instruction", choices=["continue", "summary", "both"], default="both")
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens)


def add_arguments(p) -> None:
    from specdec.models import WEIGHTS

    add_prompt_arguments(p, "1024,2048,4096,7000", 128)
    p.add_argument("--methods", type=name_list, default="hf-generate,none,streaming,snapkv,prompt-lookup")
    p.add_argument("--budgets", type=int_list, default="256,512,1024", help="KV rows of streaming and snapkv")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="sequences per run: B books of one length as one batch (MagicDec's regime)")
    p.add_argument("--memory", action="store_true", help="peak RSS per method (a child process each)")
    p.add_argument("--weights", choices=WEIGHTS, default="fp32",
                   help="the target's weights, as for `specdec generate` (packed: a GGUF's blocks kept packed)")
    add_numerics_argument(p)  # int8: "identical" is then against its own plain decoding, `none` (quant.numerics)
    p.add_argument("--out", default="results/longctx", help="appends OUT.jsonl; writes OUT.json (summary)")


def read_done(log: AnswerFile) -> dict[str, dict[str, dict]]:
    """prompt key -> method -> record, from a resumed run's records."""
    done: dict[str, dict[str, dict]] = {}
    for r in log.records.values():
        if "output" in r:  # a record of a batch-1 run before --batch-size
            r["outputs"] = [r.pop("output")]
        done.setdefault(r["prompt"], {})[r["method"]] = r
    return done


def run_prompts(model, prompts: list[LongPrompt], methods: list[MethodSpec], max_new_tokens: int, eos,
                log: AnswerFile, say, reference: str = "hf-generate") -> list[dict]:
    """Every method missing from ``log`` on every prompt, methods rotating from prompt to prompt; a
    prompt's records are appended once all its methods have run (they hold ratios to HF's and to
    ``none``'s runs). Returns the log's records and the new ones."""
    done = read_done(log)
    records = [r for per in done.values() for r in per.values()]
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            have = done.get(prompt.key, {})  # records are written per prompt, so only a changed
            todo = [m for m in methods if m.name not in have]  # --methods/--budgets leaves gaps
            if not todo:
                continue
            results = dict(have)  # earlier records of this prompt serve as references (HF, none)
            for m in rotated(todo, i):
                say(f"{prompt.key} ({prompt.tokens} tokens): {m.name}")
                results[m.name] = run_method(m, model, prompt.rows, max_new_tokens, eos)
            new = [r for r in finish_records(prompt, results, reference) if r["method"] not in have]
            for r in new:
                log.append(r)
            records += new
    return records


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdec.models import load_model
    from specdec.quant.numerics import Numerics, numerics_of

    if args.methods[0] != "hf-generate":
        raise ValueError("--methods must start with hf-generate: every output is checked against it")
    instructions = list(INSTRUCTIONS) if args.instruction == "both" else [args.instruction]
    if args.memory and args.batch_size > 1:
        raise ValueError("--memory measures one sequence: run it without --batch-size")
    books = read_books(Path(args.questions) if args.questions else BOOKS)[: args.books]
    console = Console(width=max(150, Console().width))  # 12 columns: never squeeze them to 80 in a pipe
    loaded = load_model(args.model, weights=args.weights, numerics=args.numerics)
    model, tok = loaded.model, loaded.tokenizer
    window = context_window(model)
    if window is not None and max(args.lengths) + args.max_new_tokens + 64 > window:
        raise ValueError(f"--lengths {max(args.lengths)} + {args.max_new_tokens} new tokens does not fit the "
                         f"model's context window of {window} tokens")
    eos = model.generation_config.eos_token_id
    prompts = build_prompts(tok, books, args.lengths, instructions, args.batch_size)
    methods = make_methods(args.methods, args.budgets)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = AnswerFile(out.with_suffix(".jsonl"), key=("prompt", "method"))
    warm = tok("Once upon a time", return_tensors="pt")["input_ids"]
    warm_up(methods, lambda m: run_method(m, model, (warm[0],) * min(args.batch_size, 2), 4, eos))
    # int8 numerics is its own reference: its plain decoding, not HF's other arithmetic (quant.numerics)
    reference = "none" if numerics_of(model) is Numerics.INT8 and "none" in args.methods else "hf-generate"
    records = run_prompts(model, prompts, methods, args.max_new_tokens, eos, log, console.log, reference)
    memory = {}
    if args.memory:
        longest = max(prompts, key=lambda p: p.tokens)
        for m in methods:
            memory[m.name] = peak_rss_mb(m, args.model, longest.input_ids, args.max_new_tokens, args.weights,
                                         args.numerics)
    summary = summarize(records, memory)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    console.print(table(summary, loaded.name, args.max_new_tokens, args.batch_size, Table))
    console.print(f"identical: rows equal to {reference}'s")
    return 0


def summarize(records: list[dict], memory: dict[str, float]) -> list[dict]:
    """One row per (length, instruction, method): means over prompts (books or batches of books)."""
    groups = group(records, lambda r: (r.get("batch", 1), r["length"], r["instruction"], r["method"]))

    def mean(rs, key):
        xs = [r[key] for r in rs if r.get(key) is not None]
        return statistics.fmean(xs) if xs else None

    rows = []
    for (batch, length, ins, method), rs in sorted(groups.items(), key=lambda kv: kv[0][:3]):
        rows.append({"batch": batch, "length": length, "instruction": ins, "method": method, "prompts": len(rs),
                     **{k: mean(rs, k) for k in ("speedup_vs_hf", "hf_tokens_per_s", "tokens_per_s", "ttft",
                                                  "accept_rate", "gamma", "predicted", "measured")},
                     "identical": sum(int(r.get("identical") or 0) for r in rs),
                     "rows": sum(r.get("batch", 1) for r in rs),
                     "peak_rss_mb": memory.get(method)})
    return rows


def table(rows: list[dict], model_name: str, max_new_tokens: int, batch: int, Table):
    t = Table(title=f"{model_name}: long-context self-speculation, {max_new_tokens} new tokens, greedy")
    cols = ("B", "length", "instr.", "method", "vs HF", "HF tok/s", "TTFT s", "accept", "gamma", "predicted",
            "measured", "identical", "peak MB")
    for c in cols:
        t.add_column(c, justify="right")
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    for r in rows:
        if r["batch"] != batch:
            continue
        t.add_row(str(r["batch"]), str(r["length"]), r["instruction"], r["method"],
                  f(r["speedup_vs_hf"], ".2f") + "x", f(r["hf_tokens_per_s"], ".1f"), f(r["ttft"], ".2f"),
                  f(r["accept_rate"], ".2f"), f(r["gamma"], ".1f"), f(r["predicted"], ".2f"), f(r["measured"], ".2f"),
                  f"{r['identical']}/{r['rows']}", f(r["peak_rss_mb"], ".0f"))
    return t
