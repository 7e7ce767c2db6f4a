"""What every benchmark harness shares: its decoders, the order methods run in, the warm-up, the
answer file it appends to and resumes from, and the grouping its summary is built on.

    decoder = make_decoder(model, "prompt-lookup@k=3")        # a fixed setting, or the controller
    warm_up(methods, lambda m: run(m, short_prompt, 4))        # one-off costs, never timed
    answers = AnswerFile(path)                                 # repairs a cut last line, resumes
    for i, q in enumerate(questions):
        for m in rotated(methods, i):                          # machine noise hits all alike
            if q.question_id not in answers[m].records: ...   # answered before: skipped
            answers[m].append(record)                          # one write per record

Harnesses: ``specdec specbench`` (specdec.cli.specbench), ``specdec bench`` (bench.generation and,
with --batch-size, bench.batch), ``specdec bench-longctx`` (bench.longctx).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch

from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.registry import make_drafter

T = TypeVar("T")


# ---------------------------------------------------------------- decoders for method names

def fixed_setting(setting: str) -> SpecDecoderConfig:
    """A drafter name's ``@`` suffix as a decoder config without the controller: ``k=N`` drafts N
    tokens every step (chains), ``n=N`` N tree nodes every step (tree drafters); no gate, no adaptation.
    Example: "k=3" -> DraftLengthConfig(initial=3, maximum=3, adaptive=False, cost_aware=False)."""
    name, _, value = setting.partition("=")
    if name not in ("k", "n") or not value.isdigit() or int(value) < 1:
        raise ValueError(f"unknown fixed setting @{setting}: use @k=N (chain length) or @n=N (tree nodes)")
    n = int(value)
    lengths = DraftLengthConfig(initial=n, minimum=1, maximum=n, adaptive=False, cost_aware=False,
                                tree_nodes=n if name == "n" else 0)
    return SpecDecoderConfig(draft_length=lengths)


def decoder_config(setting: str) -> SpecDecoderConfig:
    """``fixed_setting(setting)``, or the default config (the controller sizes drafts) when empty."""
    return fixed_setting(setting) if setting else SpecDecoderConfig()


def make_decoder(model, drafter_name: str, prepare=None) -> SpecDecoder:
    """A decoder for a ``--drafters`` entry: a registry name, or ``name@k=N`` / ``name@n=N`` for a
    fixed setting instead of the controller (``fixed_setting``). ``prepare(drafter)`` runs once first."""
    name, _, setting = drafter_name.partition("@")
    config = decoder_config(setting)
    drafter = make_drafter(name, model)
    if prepare is not None and drafter is not None:
        prepare(drafter)
    return SpecDecoder(model, drafter, config)


# ---------------------------------------------------------------- order and warm-up

def rotated(items: list[T], i: int) -> list[T]:
    """``items`` started at position i (mod its length): the order of methods for the i-th question,
    so a slow stretch of the machine does not always fall on the same method.
    Example: [a, b, c], 4 -> [b, c, a]."""
    k = i % len(items) if items else 0
    return items[k:] + items[:k]


def warm_up(methods: Iterable[T], run: Callable[[T], object]) -> None:
    """``run(m)`` once per method, untimed: first calls pay one-off costs (the allocator, kernels'
    first use, a drafter's corpus index) that are not the method's speed. Warnings a short warm-up
    prompt may raise (it fits every budget) are not news."""
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in methods:
            run(m)


def group(records: Iterable[dict], key: Callable[[dict], object]) -> dict:
    """Records by ``key(record)``, in first-seen order. Example: by method, by task."""
    out: dict = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return out


# ---------------------------------------------------------------- answer files (append, resume)

class AnswerFile:
    """Records, one JSON line each, keyed by the fields ``key`` names; ``records`` maps a key (the
    field's value for one field, a tuple for several) to its record.

    Opening repairs what a killed run can leave: a last line cut short (no newline, or not JSON) is
    dropped from the file, so its record is made again and appears exactly once. A broken line
    *before* the last one is not something a kill produces: that is an error naming the line.
    ``fresh`` empties the file first (a harness that does not resume).
    """

    def __init__(self, path: Path, key: tuple[str, ...] = ("question_id",), fresh: bool = False) -> None:
        self.path, self.key = Path(path), key
        self.records: dict = {}
        if fresh:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        elif self.path.exists():
            self._load()

    def key_of(self, rec: dict):
        values = tuple(rec[k] for k in self.key)
        return values[0] if len(values) == 1 else values

    def _parse(self, raw: bytes) -> dict | None:
        """A JSON object with the key's fields, or None."""
        try:
            rec = json.loads(raw)
        except ValueError:
            return None
        return rec if isinstance(rec, dict) and all(k in rec for k in self.key) else None

    def _load(self) -> None:
        data = self.path.read_bytes()
        *complete, tail = data.split(b"\n")  # tail: bytes after the last newline (b"" if clean)
        for lineno, raw in enumerate(complete, start=1):
            if raw.strip():
                rec = self._parse(raw)
                if rec is None:  # we write a record and its newline in one call: this is damage
                    raise ValueError(f"{self.path}:{lineno}: broken answer record; a killed run only "
                                     "cuts the last line, so this file was edited or corrupted")
                self._add(rec, lineno)
        if not tail.strip():
            return
        rec = self._parse(tail)
        if rec is None:  # the record a kill interrupted: cut it off, it is made again
            with open(self.path, "r+b") as f:
                f.truncate(len(data) - len(tail))
        else:  # a whole record whose newline was not written yet: keep it
            self._add(rec, len(complete) + 1)
            with open(self.path, "ab") as f:
                f.write(b"\n")

    def _add(self, rec: dict, lineno: int) -> None:
        key = self.key_of(rec)
        if key in self.records:
            what = ", ".join(f"{k.removesuffix('_id')} {rec[k]!r}" for k in self.key)
            raise ValueError(f"{self.path}:{lineno}: second answer for {what}")
        self.records[key] = rec

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)  # one write of the whole line, flushed on close: a kill cuts at most this line
            f.flush()
        self.records[self.key_of(record)] = record


def check_run_settings(out_dir: Path, settings: dict) -> None:
    """The first run of an output directory fixes its settings (model, dtype, max_new_tokens, ...); a
    rerun with other settings would mix incomparable answers, so it is refused."""
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


def file_name(s: str) -> str:
    """``s`` safe as a file name: anything but letters, digits and -_. becomes _."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)
