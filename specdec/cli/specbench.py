"""`specdec specbench`: Spec-Bench's protocol on our drafters, resumable, answers written as it goes.

For each question every method answers every turn greedily (or, with ``--temperature T > 0``, by
sampling: HF with ``do_sample=True``, ours losslessly, both from the same processed distribution)
with the model's chat template; turn 2 is asked after the method's *own* answer to turn 1 (the
conversation Spec-Bench runs). Methods:

    baseline     plain HF ``model.generate`` (greedy): what Spec-Bench's speedups are relative to
    <drafter>    SpecDecoder(model, registry drafter), e.g. prompt-lookup, early-exit, none

The order of methods rotates from question to question so machine noise hits all of them alike.
Each answer is appended (and flushed) to ``OUT/model_answer/<model>-<method>.jsonl`` in Spec-Bench's
answer format the moment it is done, so a killed run loses at most the answer in flight; a rerun
skips answered questions (a truncated last line is cut off and answered again, never duplicated).

Figures (Spec-Bench's definitions, ``evaluation/speed.py``), per task and overall:
    speedup                mean over questions of tokens/s of the method, over the same mean for the
                           baseline (tokens/s of a question = its new tokens / its seconds, all turns)
    mean accepted tokens   total new tokens / total target forwards (= mean of accept_lengths)
    identical              every answer token-identical to the baseline's (the lossless check);
                           not compared when sampling (samples differ; tests/test_sampling.py checks
                           the distribution instead)
"""

from __future__ import annotations

import platform
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.bench.batch import left_padded, until_eos
from specdec.bench.generation import prepare_corpus_drafter
from specdec.decoder import SpecDecoder
from specdec.bench.questions import Question, load_questions, select_questions
from specdec.bench.runner import AnswerFile, check_run_settings, file_name, rotated, warm_up
from specdec.bench.specbench_figures import BASELINE, print_summary, summarize
from specdec.arguments import MODEL_DTYPES, name_list, non_negative_float, positive_int
from specdec.jsonl import write_json_atomic
from specdec.prompting import chat_ids, context_window, eos_ids, has_chat_template, pad_id, reply_room
from specdec.registry import DRAFTERS, make_drafter
from specdec.sampling import sampling_kwargs


@dataclass(frozen=True)
class SpecBenchConfig:
    out_dir: Path = Path("results/specbench")
    drafters: tuple[str, ...] = ("prompt-lookup",)  # registry names, each compared with the baseline
    max_new_tokens: int = 1024  # Spec-Bench's setting
    warmup_tokens: int = 8  # one untimed short generation per method first (allocator, first calls)
    temperature: float = 0.0  # > 0: every method samples (HF's other defaults, e.g. top_k 50); 0: greedy
    # > 1: throughput mode: questions answered batch_size at a time, turn by turn (HF: one batched
    # generate with left padding); each answer's wall_time is its share, by tokens, of its batch's time
    batch_size: int = 1


@dataclass(frozen=True)
class TurnResult:
    token_ids: list[int]  # generated ids, EOS included when the model stopped on it (as HF returns)
    wall_time: float  # seconds inside the generate call (tokenising and decoding text excluded)
    accept_lengths: list[int]  # per target forward: tokens it added (accepted drafts + 1)


Answerer = Callable[[torch.Tensor, int], TurnResult]  # (input_ids [1, P], max_new_tokens) -> result


def hf_generate_answerer(model, eos: list[int], pad: int, temperature: float = 0.0) -> Answerer:
    sampling = sampling_kwargs(model, temperature)

    def answer(ids: torch.Tensor, max_new_tokens: int) -> TurnResult:
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, **sampling)
        dt = time.perf_counter() - t
        new = out[0, ids.shape[1]:].tolist()
        return TurnResult(new, dt, [1] * len(new))  # one forward per token

    return answer


def _drafter(model, name: str, questions: list[Question] | None, tokenizer):
    """The named drafter; one that keeps a corpus (suffix-corpus, auto) without the stored answers to
    the benchmark's own ``questions``, its index built before any timed answer."""
    drafter = make_drafter(name, model)
    if drafter is not None and questions:
        prepare_corpus_drafter(drafter, questions, tokenizer, exclude=True, corpus_file=None, say=lambda *_: None)
    return drafter


def specdec_answerer(model, drafter_name: str, eos: list[int], temperature: float = 0.0,
                     questions: list[Question] | None = None, tokenizer=None) -> Answerer:
    decoder = SpecDecoder(model, _drafter(model, drafter_name, questions, tokenizer))  # drafters reset in begin()
    sampling = sampling_kwargs(model, temperature)

    def answer(ids: torch.Tensor, max_new_tokens: int) -> TurnResult:
        lengths: list[int] = []  # what each step really added (EOS / length truncation included)
        t = time.perf_counter()
        out = decoder.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos,
                               callback=lambda ev: lengths.append(len(ev.tokens)), **sampling)
        dt = time.perf_counter() - t
        return TurnResult(out.sequences[0, ids.shape[1]:].tolist(), dt, lengths)

    return answer


BatchAnswerer = Callable[[list[torch.Tensor], int], list[TurnResult]]  # ([P_b] each, max_new) -> per row


def hf_batch_answerer(model, eos: list[int], pad: int, temperature: float = 0.0) -> BatchAnswerer:
    sampling = sampling_kwargs(model, temperature)

    def answer(prompts: list[torch.Tensor], max_new_tokens: int) -> list[TurnResult]:
        ids, mask = left_padded(prompts, pad)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=pad, **sampling)
        dt = time.perf_counter() - t
        rows = [until_eos(row, eos) for row in out[:, ids.shape[1]:].tolist()]
        return _shares(rows, dt, [[1] * len(r) for r in rows])

    return answer


def specdec_batch_answerer(model, drafter_name: str, eos: list[int], temperature: float = 0.0,
                           questions: list[Question] | None = None, tokenizer=None) -> BatchAnswerer:
    decoder = SpecDecoder(model, _drafter(model, drafter_name, questions, tokenizer))
    sampling = sampling_kwargs(model, temperature)

    def answer(prompts: list[torch.Tensor], max_new_tokens: int) -> list[TurnResult]:
        lengths: list[list[int]] = [[] for _ in prompts]  # per sequence: what each of its steps added

        def on_step(ev):
            lengths[ev.sequence].append(len(ev.tokens))

        t = time.perf_counter()
        out = decoder.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos, callback=on_step,
                               **sampling)
        dt = time.perf_counter() - t
        return _shares([out.generated(b).tolist() for b in range(len(prompts))], dt, lengths)

    return answer


def _shares(rows: list[list[int]], seconds: float, accept_lengths: list[list[int]]) -> list[TurnResult]:
    """A batch's answers, each with its share of the batch's seconds by tokens (so per-question
    tokens/s is the batch's throughput)."""
    total = max(1, sum(len(r) for r in rows))
    return [TurnResult(r, seconds * len(r) / total, a) for r, a in zip(rows, accept_lengths)]


def _new_choice() -> dict:
    return {"index": 0, "turns": [], "new_tokens": [], "wall_time": [], "decoding_steps": [],
            "accept_lengths": [], "token_ids": []}


def _add_turn(choice: dict, res: TurnResult, text: str) -> None:
    choice["turns"].append(text)
    choice["new_tokens"].append(len(res.token_ids))
    choice["wall_time"].append(res.wall_time)
    choice["decoding_steps"].append(len(res.accept_lengths))
    choice["accept_lengths"].extend(res.accept_lengths)  # flat over turns, as Spec-Bench stores it
    choice["token_ids"].append(res.token_ids)


def answer_batch(tokenizer, questions: list[Question], answer: BatchAnswerer, max_new_tokens: int,
                 context_window: int | None) -> list[dict]:
    """Every turn of each question, each after that question's *own* earlier answers: Spec-Bench's
    ``choices[0]`` (turns, new_tokens, wall_time, decoding_steps, accept_lengths) plus token_ids.
    Turn t of every question that has one is answered in one call of ``answer``."""
    messages: list[list[dict]] = [[] for _ in questions]
    choices = [_new_choice() for _ in questions]
    for t in range(max(len(q.turns) for q in questions)):
        live = [i for i, q in enumerate(questions) if t < len(q.turns)]
        ids = []
        for i in live:
            messages[i].append({"role": "user", "content": questions[i].turns[t]})
            ids.append(chat_ids(tokenizer, messages[i])[0])
        longest = max(map(len, ids))
        room = reply_room(context_window, longest, max_new_tokens)
        if room < 1:
            raise ValueError(f"question {', '.join(str(questions[i].question_id) for i in live)}: the conversation "
                             f"({longest} tokens) leaves no room in the model's context window of "
                             f"{context_window} tokens")
        for i, res in zip(live, answer(ids, room)):
            text = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
            messages[i].append({"role": "assistant", "content": text})
            _add_turn(choices[i], res, text)
    return choices


def answer_question(tokenizer, question: Question, answer: Answerer, max_new_tokens: int,
                    context_window: int | None) -> dict:
    """``answer_batch`` for one question, one sequence at a time ([1, P] prompts)."""
    return answer_batch(tokenizer, [question], lambda ids, n: [answer(ids[0][None], n)], max_new_tokens,
                        context_window)[0]


# ---------------------------------------------------------------- the run

Progress = Callable[[str, int, int], None]  # (what is being answered, answers to write, written)


def _answer_files(out_dir: Path, model, model_name: str, questions: list[Question], config: SpecBenchConfig,
                  methods: list[str]) -> dict[str, AnswerFile]:
    """Each method's answer file, opened (repaired, resumed); refuses a directory of other settings."""
    answer_dir = out_dir / "model_answer"
    answer_dir.mkdir(parents=True, exist_ok=True)
    check_run_settings(out_dir, {"model": model_name, "dtype": str(model.dtype),
                                 "max_new_tokens": config.max_new_tokens,
                                 **({"temperature": config.temperature} if config.temperature else {}),
                                 **({"batch_size": config.batch_size} if config.batch_size > 1 else {})})
    files = {m: AnswerFile(answer_dir / f"{file_name(model_name)}-{file_name(m)}.jsonl") for m in methods}
    for m, f in files.items():
        for q in questions:
            rec = f.records.get(q.question_id)
            if rec is not None and rec.get("category") != q.category:
                raise ValueError(f"{f.path}: question {q.question_id!r} was answered as category "
                                 f"{rec.get('category')!r}, the question file says {q.category!r}: "
                                 "answers from another question file; choose another --out")
    return files


def _answerers(model, tokenizer, questions: list[Question], config: SpecBenchConfig) -> dict:
    """method -> its Answerer, or at batch_size > 1 its BatchAnswerer."""
    eos = eos_ids(model, tokenizer, required=True)  # the same stop tokens for every method
    pad = pad_id(tokenizer, eos)
    T = config.temperature
    if config.batch_size > 1:
        return {BASELINE: hf_batch_answerer(model, eos, pad, T),
                **{d: specdec_batch_answerer(model, d, eos, T, questions, tokenizer) for d in config.drafters}}
    return {BASELINE: hf_generate_answerer(model, eos, pad, T),
            **{d: specdec_answerer(model, d, eos, T, questions, tokenizer) for d in config.drafters}}


def answer_all(model, tokenizer, model_name: str, questions: list[Question], config: SpecBenchConfig,
               progress: Progress | None = None) -> dict[str, AnswerFile]:
    """Answer every (question, method) pair not yet in the answer files, one question (or, at
    batch_size > 1, one batch) at a time with the methods rotating; each answer is written as soon
    as its question (batch) is done, so a crash loses at most that. Returns the files."""
    methods = [BASELINE, *config.drafters]
    if len(set(methods)) != len(methods):
        raise ValueError(f"each method once, please: {', '.join(methods)}")
    files = _answer_files(config.out_dir, model, model_name, questions, config, methods)
    todo = [(i, q) for i, q in enumerate(questions) if any(q.question_id not in files[m].records for m in methods)]
    total = sum(q.question_id not in files[m].records for _, q in todo for m in methods)
    say = progress or (lambda *_: None)
    if not todo:
        say("all answered already", 0, 0)
        return files
    answerers = _answerers(model, tokenizer, questions, config)
    B, N, window = config.batch_size, config.max_new_tokens, context_window(model)

    def answer(m: str, qs: list[Question]) -> list[dict]:
        if B == 1:
            return [answer_question(tokenizer, qs[0], answerers[m], N, window)]
        return answer_batch(tokenizer, qs, answerers[m], N, window)

    # (rotation index, questions): one question at its index in the file, or a batch at its number
    chunks = [(i, [q]) for i, q in todo] if B == 1 else \
        [(k // B, [q for _, q in todo[k: k + B]]) for k in range(0, len(todo), B)]
    with torch.inference_mode():
        if config.warmup_tokens > 0:  # first calls pay one-off costs; not measured
            hello = chat_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
            warm = hello if B == 1 else [hello[0], hello[0][1:]]
            warm_up(methods, lambda m: answerers[m](warm, config.warmup_tokens))
        written = 0
        for r, chunk in chunks:
            for m in rotated(methods, r):
                qs = [q for q in chunk if q.question_id not in files[m].records]
                if not qs:
                    continue
                say(f"q{qs[0].question_id} {qs[0].category} · {m}" if B == 1 else
                    f"batch of {len(qs)} from q{qs[0].question_id} · {m}", total, written)
                for q, choice in zip(qs, answer(m, qs)):
                    files[m].append({"question_id": q.question_id, "category": q.category,
                                     "answer_id": uuid.uuid4().hex[:22], "model_id": f"{model_name}-{m}",
                                     "choices": [choice], "tstamp": time.time(),
                                     **({"batch_size": len(qs)} if B > 1 else {})})
                    written += 1
        say("done", total, written)
    return files


def evaluate(model, tokenizer, model_name: str, questions: list[Question], config: SpecBenchConfig,
             console=None) -> dict:
    """Answer what is missing (progress bar), then summarise, save ``OUT/summary.json`` and print."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = console or Console()
    if not has_chat_template(tokenizer):
        raise ValueError(f"{model_name}'s tokenizer has no chat template; Spec-Bench prompts through one")
    with Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("reading answer files", total=None)
        files = answer_all(model, tokenizer, model_name, questions, config,
                           lambda what, total, done: bar.update(task, description=what, total=total,
                                                                completed=done))
    summary = summarize({m: f.records for m, f in files.items()}, questions, temperature=config.temperature)
    summary["meta"] = {
        "model": model_name, "dtype": str(model.dtype), "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "questions": len(questions), "answers": str(config.out_dir / "model_answer"),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M")}
    write_json_atomic(config.out_dir / "summary.json", summary)  # never a half-written summary
    print_summary(console, summary, f"Spec-Bench · {model_name} · {len(questions)} questions · "
                  f"max {config.max_new_tokens} new tokens · "
                  + ("greedy" if not config.temperature else f"sampling at temperature {config.temperature}"))
    console.print(f"[dim]answers: {config.out_dir / 'model_answer'}  summary: "
                  f"{config.out_dir / 'summary.json'}[/dim]")
    return summary


# ---------------------------------------------------------------- CLI

def add_arguments(p) -> None:
    p.add_argument("--questions", default=None,
                   help="Spec-Bench question.jsonl (default: the small set shipped with specdec)")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    p.add_argument("--drafter", action="append", choices=sorted(DRAFTERS), default=None,
                   help="drafter to compare with the baseline; repeat for several (default: prompt-lookup)")
    p.add_argument("--max-new-tokens", type=positive_int, default=1024, help="per turn (Spec-Bench: 1024)")
    p.add_argument("--limit-per-category", type=positive_int, default=None, help="first N questions of each category")
    p.add_argument("--categories", type=name_list, default=None, help="comma-separated categories (default: all)")
    p.add_argument("--out", default="results/specbench", help="directory for answers and summary.json")
    p.add_argument("--dtype", default="float32", choices=sorted(MODEL_DTYPES), help="model weights dtype")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice); recorded in summary.json")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (default): greedy, answers compared token for token with HF's; > 0: every "
                        "method samples (HF generate with do_sample=True and HF's other defaults, "
                        "e.g. top_k 50), answers not compared; tau and speedup still reported")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="> 1: throughput mode, questions answered this many at a time (HF: batched generate, "
                        "left padding); answers keep Spec-Bench's format, one line per question")


def run(args) -> int:
    from specdec.models import load_model

    questions = load_questions(args.questions)
    questions = select_questions(questions, categories=args.categories or None,
                                 limit_per_category=args.limit_per_category)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-tensor loading bar: noise here
    loaded = load_model(args.model, dtype=MODEL_DTYPES[args.dtype], weights="fp32")
    if loaded.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; Spec-Bench needs one with a chat template")
    config = SpecBenchConfig(out_dir=Path(args.out), drafters=tuple(args.drafter or ("prompt-lookup",)),
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             batch_size=args.batch_size)
    evaluate(loaded.model, loaded.tokenizer, loaded.name, questions, config)
    return 0
