"""Self-distilled EAGLE-3 data at the speed of the target's device, its features held in memory.

    n = answer_prompts(target, prompt_ids, "answers.jsonl", AnswerConfig(batch_size=512))   # resumable
    convs = features(target, read_answers("answers.jsonl"), aux_layers=(2, 15, 27))
    train_head3(target, convs, "out/eagle3", Train3Config(...))

The data stage of ``eagle_data`` writes one file of features per conversation, which suits a CPU (a
few hundred conversations a session). A GPU answers thousands a minute, and their EAGLE-3 features
(4 x D floats a token: three layers' inputs and the last hidden state) would fill its disk (8,000
answers of the default model: ~50 GB in fp32). So here the answers (token ids) are appended to an
answers file as each batch finishes (a run that stops resumes from it, and later runs rebuild from it),
and the features come from batched forwards, kept in memory in ``dtype`` on the target's device.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.forward import hidden_of
from specdec.jsonl import read_jsonl
from specdec.training.eagle_data import Conversation, _answer_of, answer_batch


@dataclass(frozen=True)
class AnswerConfig:
    max_new_tokens: int = 384  # answer length per prompt
    batch_size: int = 256  # prompts answered together (left-padded HF generate), similar lengths together
    minutes: float | None = None  # stop starting new batches after this long (None: answer every prompt)
    temperature: float = 0.0  # 0: greedy answers; > 0: sampled from the target at this temperature (more varied text)
    seed: int = 0  # sampling seed; a batch whose first prompt is conversation i uses seed + i


def read_answers(path: str | os.PathLike) -> list[tuple[int, int, list[int]]]:
    """(conv, prompt_len, ids) per line of an answers file (none if it does not exist yet); a last line cut
    by a crash (no newline) is skipped, any other malformed line is named."""
    return read_jsonl(path, _answer_of, "an answer", cut_last=True) if Path(path).exists() else []


def shard_path(path: str | os.PathLike, rank: int, world: int) -> Path:
    """The answers file rank r of W appends to: ``path`` itself for one rank, else ``NAME.rank{r}-of-{W}.jsonl``
    beside it (ranks never append to one file)."""
    path = Path(path)
    return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}-of-{world}{path.suffix}")


def answer_files(path: str | os.PathLike) -> list[Path]:
    """``path`` and every rank's file beside it (of any rank count), those that exist."""
    path = Path(path)
    ranked = sorted(path.parent.glob(f"{path.stem}.rank*-of-*{path.suffix}"))
    return [p for p in [path, *ranked] if p.exists()]


def read_all_answers(path: str | os.PathLike) -> list[tuple[int, int, list[int]]]:
    """Every answer in ``answer_files(path)``, one per conversation (the first file's), by conv."""
    seen: dict[int, tuple[int, int, list[int]]] = {}
    for f in answer_files(path):
        for a in read_answers(f):
            seen.setdefault(a[0], a)
    return [seen[c] for c in sorted(seen)]


def _drop_cut_line(path: Path) -> None:
    """Truncate a last line a crash cut (no newline), so appended lines start on their own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, rows: list[dict]) -> None:
    """Whole lines in one write, flushed to disk: a crash cuts at most the last line (read_answers drops it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


@torch.inference_mode()
def answer_prompts(target, prompts: list[list[int]], path: str | os.PathLike, config: AnswerConfig = AnswerConfig(),
                   first_conv: int = 0, log=print, clock=time.monotonic, shard: tuple[int, int] = (0, 1)) -> int:
    """Answers of ``target`` to ``prompts`` (token ids; greedy, or sampled at ``config.temperature``),
    appended to the answers file ``path`` as conversations ``first_conv + i``; prompts already answered
    there (or in a rank's file beside it: ``answer_files``) are skipped. ``shard`` (rank r, ranks W): only
    conversations c with c % W == r, appended to ``shard_path(path, r, W)``. Returns how many were
    answered by this call."""
    r, W = shard
    _drop_cut_line(shard_path(path, r, W))  # its own file only: the other ranks may be appending to theirs
    done = {conv for conv, _, _ in read_all_answers(path)}  # a line another crash cut is skipped there
    path = shard_path(path, r, W)
    todo = sorted((i for i in range(len(prompts)) if first_conv + i not in done and (first_conv + i) % W == r),
                  key=lambda i: len(prompts[i]))
    start, answered = clock(), 0
    for at in range(0, len(todo), config.batch_size):
        if config.minutes is not None and clock() - start > 60 * config.minutes:
            log(f"answers: stopped after {config.minutes:g} min, {len(todo) - at} prompts left for a later run")
            break
        chunk = todo[at : at + config.batch_size]
        answers = answer_batch(target, [prompts[i] for i in chunk], config.max_new_tokens, config.temperature,
                               config.seed + first_conv + chunk[0])
        rows = [{"conv": first_conv + i, "prompt_len": len(prompts[i]), "ids": prompts[i] + answer}
                for i, answer in zip(chunk, answers)]
        _append(path, rows)
        answered += len(chunk)
        log(f"answers: {answered}/{len(todo)} ({clock() - start:.0f} s)")
    return answered


@torch.inference_mode()
def features(target, answers: list[tuple[int, int, list[int]]], aux_layers: tuple[int, ...],
             dtype: torch.dtype = torch.bfloat16, tokens_per_batch: int = 65536, max_len: int = 1024
             ) -> list[Conversation]:
    """One ``Conversation`` per answer, its features from batched target forwards (right-padded: a
    causal model's rows before the padding are what a forward over the conversation alone gives, up
    to summation order), held in ``dtype`` on the target's device; ids on the CPU. Conversations are
    cut at ``max_len`` tokens (training sees no more)."""
    device = target.device
    length = lambda i: min(max_len, len(answers[i][2]))  # noqa: E731
    groups: list[list[int]] = [[]]
    for i in sorted(range(len(answers)), key=length):  # ascending: a group's last is its width
        if groups[-1] and (len(groups[-1]) + 1) * length(i) > tokens_per_batch:
            groups.append([])
        groups[-1].append(i)
    convs: list[Conversation | None] = [None] * len(answers)
    for group in filter(None, groups):
        width = length(group[-1])
        x = torch.zeros(len(group), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(group), width, dtype=torch.long, device=device)
        for row, i in enumerate(group):
            ids = answers[i][2][:max_len]
            x[row, : len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
            mask[row, : len(ids)] = 1
        states = target(x, attention_mask=mask, output_hidden_states=True).hidden_states
        last, aux = states[-1].to(dtype), hidden_of(states, aux_layers).to(dtype)
        for row, i in enumerate(group):
            n = length(i)
            convs[i] = Conversation(x[row, :n].cpu(), last[row, :n].clone(), answers[i][1], aux[row, :n].clone(),
                                    tuple(aux_layers))
    return [c for c in convs if c is not None]
