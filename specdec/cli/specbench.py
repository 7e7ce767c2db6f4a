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

import json
import os
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
from specdec.models import text_config
from specdec.bench.questions import TASKS, Question, load_questions, select_questions, task_of
from specdec.registry import DRAFTERS, make_drafter
from specdec.sampling import sampling_kwargs

BASELINE = "baseline"  # plain HF generate, greedy
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


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


def answer_batch(tokenizer, questions: list[Question], answer: BatchAnswerer, max_new_tokens: int,
                 context_window: int | None) -> list[dict]:
    """``answer_question`` for several questions at once: turn t of every question that has one is
    answered in one batch, after that question's own earlier answers."""
    messages: list[list[dict]] = [[] for _ in questions]
    choices = [{"index": 0, "turns": [], "new_tokens": [], "wall_time": [], "decoding_steps": [],
                "accept_lengths": [], "token_ids": []} for _ in questions]
    for t in range(max(len(q.turns) for q in questions)):
        live = [i for i, q in enumerate(questions) if t < len(q.turns)]
        ids = []
        for i in live:
            messages[i].append({"role": "user", "content": questions[i].turns[t]})
            ids.append(chat_input_ids(tokenizer, messages[i])[0])
        room = max_new_tokens if context_window is None else min(max_new_tokens, context_window - max(map(len, ids)))
        if room < 1:
            raise ValueError(f"questions {[questions[i].question_id for i in live]}: a conversation leaves no "
                             f"room in the model's context window of {context_window} tokens")
        for i, res in zip(live, answer(ids, room)):
            text = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
            messages[i].append({"role": "assistant", "content": text})
            c = choices[i]
            c["turns"].append(text)
            c["new_tokens"].append(len(res.token_ids))
            c["wall_time"].append(res.wall_time)
            c["decoding_steps"].append(len(res.accept_lengths))
            c["accept_lengths"].extend(res.accept_lengths)
            c["token_ids"].append(res.token_ids)
    return choices


# ---------------------------------------------------------------- one question, as a conversation

def chat_input_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """[1, P] the chat template applied to ``messages``, ready for the assistant's reply."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply: the generation config's EOS (SmolLM2 chat: <|im_end|> = 2), else the
    tokenizer's. Every method gets the same list."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("neither the model's generation config nor its tokenizer names an EOS token")
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def answer_question(tokenizer, question: Question, answer: Answerer, max_new_tokens: int,
                    context_window: int | None) -> dict:
    """Every turn of ``question``, each after this method's own previous answers: Spec-Bench's
    ``choices[0]`` (turns, new_tokens, wall_time, decoding_steps, accept_lengths) plus token_ids."""
    messages: list[dict] = []
    choice = {"index": 0, "turns": [], "new_tokens": [], "wall_time": [], "decoding_steps": [],
              "accept_lengths": [], "token_ids": []}
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        ids = chat_input_ids(tokenizer, messages)
        room = max_new_tokens if context_window is None else min(max_new_tokens, context_window - ids.shape[1])
        if room < 1:
            raise ValueError(f"question {question.question_id}: the conversation ({ids.shape[1]} tokens) "
                             f"leaves no room in the model's context window of {context_window} tokens")
        res = answer(ids, room)
        text = tokenizer.decode(res.token_ids, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": text})
        choice["turns"].append(text)
        choice["new_tokens"].append(len(res.token_ids))
        choice["wall_time"].append(res.wall_time)
        choice["decoding_steps"].append(len(res.accept_lengths))
        choice["accept_lengths"].extend(res.accept_lengths)  # flat over turns, as Spec-Bench stores it
        choice["token_ids"].append(res.token_ids)
    return choice


# ---------------------------------------------------------------- answer files (append, resume)

class AnswerFile:
    """One method's answers, one JSON line per question; ``records`` maps question_id -> record.

    Opening repairs what a killed run can leave: a last line cut short (no newline, or not JSON) is
    dropped from the file, so its question is answered again and appears exactly once. A broken line
    *before* the last one is not something a kill produces: that is an error naming the line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[int | str, dict] = {}
        if path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        *complete, tail = data.split(b"\n")  # tail: bytes after the last newline (b"" if clean)
        for lineno, raw in enumerate(complete, start=1):
            if raw.strip():
                rec = _parse_record(raw)
                if rec is None:  # we write a record and its newline in one call: this is damage
                    raise ValueError(f"{self.path}:{lineno}: broken answer record; a killed run only "
                                     "cuts the last line, so this file was edited or corrupted")
                self._add(rec, lineno)
        if not tail.strip():
            return
        rec = _parse_record(tail)
        if rec is None:  # the record a kill interrupted: cut it off, its question is answered again
            with open(self.path, "r+b") as f:
                f.truncate(len(data) - len(tail))
        else:  # a whole record whose newline was not written yet: keep it
            self._add(rec, len(complete) + 1)
            with open(self.path, "ab") as f:
                f.write(b"\n")

    def _add(self, rec: dict, lineno: int) -> None:
        qid = rec["question_id"]
        if qid in self.records:
            raise ValueError(f"{self.path}:{lineno}: second answer for question {qid!r}")
        self.records[qid] = rec

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)  # one write of the whole line, flushed on close: a kill cuts at most this line
            f.flush()
        self.records[record["question_id"]] = record


def _parse_record(raw: bytes) -> dict | None:
    """A JSON object with a question_id, or None."""
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "question_id" in rec else None


def _check_run_settings(out_dir: Path, settings: dict) -> None:
    """The first run of an output directory fixes model, dtype and max_new_tokens; a rerun with other
    settings would mix incomparable answers, so it is refused."""
    path = out_dir / "run.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            what = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise ValueError(f"{out_dir} holds answers from a run with other settings ({what}); "
                             "choose another --out or delete that directory")
    else:
        path.write_text(json.dumps(settings, indent=1) + "\n")


def _file_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)


# ---------------------------------------------------------------- the run

Progress = Callable[[str, int, int], None]  # (what is being answered, answers to write, written)


def answer_all(model, tokenizer, model_name: str, questions: list[Question], config: SpecBenchConfig,
               progress: Progress | None = None) -> dict[str, AnswerFile]:
    """Answer every (question, method) pair not yet in the answer files; returns the files."""
    methods = [BASELINE, *config.drafters]
    if len(set(methods)) != len(methods):
        raise ValueError(f"each method once, please: {', '.join(methods)}")
    answer_dir = config.out_dir / "model_answer"
    answer_dir.mkdir(parents=True, exist_ok=True)
    _check_run_settings(config.out_dir, {"model": model_name, "dtype": str(model.dtype),
                                         "max_new_tokens": config.max_new_tokens,
                                         **({"temperature": config.temperature} if config.temperature else {}),
                                         **({"batch_size": config.batch_size} if config.batch_size > 1 else {})})
    files = {m: AnswerFile(answer_dir / f"{_file_name(model_name)}-{_file_name(m)}.jsonl") for m in methods}
    for m, f in files.items():
        for q in questions:
            rec = f.records.get(q.question_id)
            if rec is not None and rec.get("category") != q.category:
                raise ValueError(f"{f.path}: question {q.question_id!r} was answered as category "
                                 f"{rec.get('category')!r}, the question file says {q.category!r}: "
                                 "answers from another question file; choose another --out")
    todo = [(i, q) for i, q in enumerate(questions) if any(q.question_id not in files[m].records for m in methods)]
    total = sum(q.question_id not in files[m].records for _, q in todo for m in methods)
    if not todo:
        if progress is not None:
            progress("all answered already", 0, 0)
        return files

    eos = stop_token_ids(model, tokenizer)  # the same stop tokens for every method
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    answerers = {BASELINE: hf_generate_answerer(model, eos, pad, config.temperature)}
    answerers.update({d: specdec_answerer(model, d, eos, config.temperature, questions, tokenizer)
                      for d in config.drafters})
    context_window = getattr(text_config(model), "max_position_embeddings", None)

    if config.batch_size > 1:
        return _answer_all_batched(model, tokenizer, model_name, questions, config, files, todo, total, eos, pad,
                                   context_window, progress)
    with torch.inference_mode():
        if config.warmup_tokens > 0:  # first calls pay one-off costs; not measured
            warm = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
            for m in methods:
                answerers[m](warm, config.warmup_tokens)
        written = 0
        for i, q in todo:
            order = methods[i % len(methods):] + methods[: i % len(methods)]  # rotate per question
            for m in order:
                if q.question_id in files[m].records:
                    continue
                if progress is not None:
                    progress(f"q{q.question_id} {q.category} · {m}", total, written)
                choice = answer_question(tokenizer, q, answerers[m], config.max_new_tokens, context_window)
                files[m].append({"question_id": q.question_id, "category": q.category,
                                 "answer_id": uuid.uuid4().hex[:22], "model_id": f"{model_name}-{m}",
                                 "choices": [choice], "tstamp": time.time()})
                written += 1
        if progress is not None:
            progress("done", total, written)
    return files


def _answer_all_batched(model, tokenizer, model_name, questions, config, files, todo, total, eos, pad,
                        context_window, progress) -> dict[str, AnswerFile]:
    """Throughput mode: the questions still to answer, batch_size at a time, methods rotating per batch;
    each batch's answers are written as soon as it is done (a crash loses at most one batch)."""
    methods = [BASELINE, *config.drafters]
    answerers = {BASELINE: hf_batch_answerer(model, eos, pad, config.temperature)}
    answerers.update({d: specdec_batch_answerer(model, d, eos, config.temperature, questions, tokenizer)
                      for d in config.drafters})
    B = config.batch_size
    with torch.inference_mode():
        if config.warmup_tokens > 0:
            warm = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello!"}])[0]
            for m in methods:
                answerers[m]([warm, warm[1:]], config.warmup_tokens)
        written = 0
        for k in range(0, len(todo), B):
            chunk = [q for _, q in todo[k : k + B]]
            order = methods[(k // B) % len(methods):] + methods[: (k // B) % len(methods)]
            for m in order:
                qs = [q for q in chunk if q.question_id not in files[m].records]
                if not qs:
                    continue
                if progress is not None:
                    progress(f"batch of {len(qs)} from q{qs[0].question_id} · {m}", total, written)
                for q, choice in zip(qs, answer_batch(tokenizer, qs, answerers[m], config.max_new_tokens,
                                                      context_window)):
                    files[m].append({"question_id": q.question_id, "category": q.category,
                                     "answer_id": uuid.uuid4().hex[:22], "model_id": f"{model_name}-{m}",
                                     "choices": [choice], "tstamp": time.time(), "batch_size": len(qs)})
                    written += 1
        if progress is not None:
            progress("done", total, written)
    return files


# ---------------------------------------------------------------- figures (pure)

def _question_speed(rec: dict) -> float:
    c = rec["choices"][0]
    return sum(c["new_tokens"]) / max(sum(c["wall_time"]), 1e-9)


def method_stats(records: list[dict], baseline: list[dict]) -> dict:
    """Spec-Bench's figures for one method over questions answered by it and the baseline (same order)."""
    assert len(records) == len(baseline), "pair each record with the baseline's for the same question"
    if not records:
        return {"questions": 0}
    speeds = [_question_speed(r) for r in records]
    base_speeds = [_question_speed(r) for r in baseline]
    tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in records)
    steps = sum(sum(r["choices"][0]["decoding_steps"]) for r in records)
    mismatched = [r["question_id"] for r, b in zip(records, baseline)
                  if r["choices"][0].get("token_ids") != b["choices"][0].get("token_ids")
                  or "token_ids" not in r["choices"][0]]
    tps, base_tps = sum(speeds) / len(speeds), sum(base_speeds) / len(base_speeds)
    return {"questions": len(records), "new_tokens": tokens, "decoding_steps": steps,
            "tokens_per_second": tps, "baseline_tokens_per_second": base_tps, "speedup": tps / base_tps,
            "mean_accepted_tokens": tokens / max(steps, 1), "identical": not mismatched,
            "mismatched_questions": mismatched}


def summarize(answers: dict[str, dict], questions: list[Question], baseline: str = BASELINE,
              temperature: float = 0.0) -> dict:
    """answers: method -> {question_id: record}. Per method, per task (Spec-Bench order) and overall,
    over the selected questions that both the method and the baseline have answered. When sampling
    (temperature > 0) answers are not compared: "identical" is None."""
    base = answers[baseline]
    tasks = [t for t in TASKS if any(task_of(q.category) == t for q in questions)]
    tasks += sorted({task_of(q.category) for q in questions} - set(tasks))
    mode = "greedy" if not temperature else f"do_sample=True, temperature {temperature}"
    out: dict = {"baseline": f"{baseline} (HF generate, {mode})", "tasks": tasks, "methods": {}}
    for m, recs in answers.items():
        done = [q for q in questions if q.question_id in recs and q.question_id in base]
        per_task = {}
        for t in tasks:
            qs = [q for q in done if task_of(q.category) == t]
            per_task[t] = method_stats([recs[q.question_id] for q in qs], [base[q.question_id] for q in qs])
        out["methods"][m] = {"overall": method_stats([recs[q.question_id] for q in done],
                                                     [base[q.question_id] for q in done]),
                             "tasks": per_task}
    if temperature:
        for m in out["methods"].values():
            for s in [m["overall"], *m["tasks"].values()]:
                s["identical"], s["mismatched_questions"] = None, None
    return out


def print_summary(console, summary: dict, title: str) -> None:
    """Rows: tasks then overall. Per drafter: speedup, tau (mean accepted tokens), lossless mark."""
    from rich.table import Table

    drafters = [m for m in summary["methods"] if m != BASELINE]
    table = Table(title=title, caption="speedup over HF generate (Spec-Bench's: ratio of mean tokens/s) · "
                  "tau: mean accepted tokens per target forward · ✓: token-identical to HF generate")
    for col in ("task", "n", "HF tok/s", *drafters):
        table.add_column(col, justify="left" if col == "task" else "right", no_wrap=True)
    base = summary["methods"][BASELINE]
    for t in [*summary["tasks"], "overall"]:
        b = base["overall"] if t == "overall" else base["tasks"][t]
        if not b["questions"]:
            continue
        row = ["[bold]overall[/bold]" if t == "overall" else t, str(b["questions"]),
               f"{b['tokens_per_second']:.1f}"]
        for d in drafters:
            s = summary["methods"][d]
            s = s["overall"] if t == "overall" else s["tasks"][t]
            if not s["questions"]:
                row.append("-")
                continue
            if s["identical"] is None:  # sampling: answers differ by design
                same = ""
            else:
                same = " [green]✓[/green]" if s["identical"] else f" [red]✗{len(s['mismatched_questions'])}[/red]"
            row.append(f"{s['speedup']:.2f}x τ{s['mean_accepted_tokens']:.2f}{same}")
        table.add_row(*row)
    console.print(table)


def evaluate(model, tokenizer, model_name: str, questions: list[Question], config: SpecBenchConfig,
             console=None) -> dict:
    """Answer what is missing (progress bar), then summarise, save ``OUT/summary.json`` and print."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = console or Console()
    if not getattr(tokenizer, "chat_template", None):
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
    tmp = config.out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, config.out_dir / "summary.json")  # never a half-written summary
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
    p.add_argument("--max-new-tokens", type=int, default=1024, help="per turn (Spec-Bench: 1024)")
    p.add_argument("--limit-per-category", type=int, default=None, help="first N questions of each category")
    p.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    p.add_argument("--out", default="results/specbench", help="directory for answers and summary.json")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model weights dtype")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); recorded in summary.json")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, answers compared token for token with HF's; > 0: every "
                        "method samples (HF generate with do_sample=True and HF's other defaults, "
                        "e.g. top_k 50), answers not compared; tau and speedup still reported")
    p.add_argument("--batch-size", type=int, default=1,
                   help="> 1: throughput mode, questions answered this many at a time (HF: batched generate, "
                        "left padding); answers keep Spec-Bench's format, one line per question")


def run(args) -> int:
    from specdec.models import load_model

    questions = load_questions(args.questions)
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    questions = select_questions(questions, categories=cats, limit_per_category=args.limit_per_category)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    sampling_kwargs(None, args.temperature)  # a bad --temperature fails before the model loads
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-tensor loading bar: noise here
    loaded = load_model(args.model, dtype=DTYPES[args.dtype])
    if loaded.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; Spec-Bench needs one with a chat template")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    config = SpecBenchConfig(out_dir=Path(args.out), drafters=tuple(args.drafter or ("prompt-lookup",)),
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             batch_size=args.batch_size)
    evaluate(loaded.model, loaded.tokenizer, loaded.name, questions, config)
    return 0
