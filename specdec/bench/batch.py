"""Batched throughput: batched HF ``generate`` vs specdec at batch sizes B, same prompts, one process.

For each B the first B selected questions (first turn, chat template) form one batch. Methods run
on that batch in an order that rotates with each repeat, so machine noise hits all alike:
    hf-generate        HF's batched generate, left padding (how HF users batch)
    specdec:NAME       SpecDecoder on the BMC store with drafter NAME (none = plain batched decoding)
Per run: total tokens/s (new tokens of every sequence over the run's seconds) and BASS's three
latencies: the first sequence finished, the last finished (= the run), and the mean over sequences.
Medians over repeats; speedups are ratios to hf-generate's in the same run.

Exactness: every specdec row is compared with specdec's own batch-1 greedy output for that prompt
(identical to HF greedy, tests/test_real_model.py). On fp32, a batch changes GEMM shapes, so a row may
differ from its batch-1 run at a near-tie: for such a row the top-2 logit gap of the target at the
first differing token is reported (it must be < 1e-3 for the difference to be rounding).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.arguments import MODEL_DTYPES
from specdec.bench.runner import AnswerFile, make_decoder, rotated, warm_up
from specdec.decoder import SpecDecoder
from specdec.prompting import encode_prompt, eos_ids, pad_id
from specdec.runtime import kernels


class _FinishClock(LogitsProcessor):
    """Records when each row of an HF batched generate finished (EOS seen, or the end of the run)."""

    def __init__(self, eos: set[int], t0: float) -> None:
        self.eos, self.t0, self.done = eos, t0, {}

    def __call__(self, input_ids, scores):
        now = time.perf_counter() - self.t0
        for b, last in enumerate(input_ids[:, -1].tolist()):
            if b not in self.done and last in self.eos:
                self.done[b] = now
        return scores


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention_mask [B, P] with each prompt right-aligned: HF's batched-generation layout."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    return ids, mask


def until_eos(row: list[int], eos) -> list[int]:
    """A generated row up to and including its first EOS (HF pads after it)."""
    return row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))]


def run_hf(model, prompts: list[torch.Tensor], max_new: int, eos: list[int], pad: int) -> dict:
    ids, mask = left_padded(prompts, pad)
    P = ids.shape[1]
    t0 = time.perf_counter()
    clock = _FinishClock(set(eos), t0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
    total = time.perf_counter() - t0
    lengths = [len(until_eos(row, eos)) for row in out[:, P:].tolist()]
    finish = [clock.done.get(b, total) for b in range(len(prompts))]
    return {"seconds": total, "tokens": sum(lengths), "finish": finish, "rows": None}


def run_specdec(decoder: SpecDecoder, prompts: list[torch.Tensor], max_new: int, eos: list[int]) -> dict:
    finish: dict[int, float] = {}
    t0 = time.perf_counter()

    def on_step(ev):
        finish[ev.sequence] = time.perf_counter() - t0  # the last event of a sequence is its finish

    out = decoder.generate(prompts, max_new_tokens=max_new, eos_token_id=eos, callback=on_step)
    total = time.perf_counter() - t0
    rows = [out.generated(b).tolist() for b in range(len(prompts))]
    return {"seconds": total, "tokens": out.new_tokens, "finish": [finish[b] for b in range(len(prompts))],
            "rows": rows, "tau": out.mean_accepted_tokens,
            "split_steps": sum(s.split for s in out.steps), "steps": len(out.steps)}


@torch.inference_mode()
def top2_gap(model, prompt: torch.Tensor, tokens: list[int]) -> float:
    """The target's top-2 logit gap after prompt + tokens (a near-tie when small)."""
    logits = model(torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])[None]).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a length difference counts), else None.
    Example: [1, 2, 3] vs [1, 2, 4, 5] -> 2."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_batches(model, tokenizer, texts: list[str], sizes: list[int], drafters: list[str], max_new: int,
                  repeats: int, log_path: Path | None, say=print) -> list[dict]:
    eos = eos_ids(model)
    pad = pad_id(tokenizer, eos)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    decoders = {d: make_decoder(model, d) for d in drafters}  # "name@k=N": a fixed setting
    methods = ["hf-generate"] + [f"specdec:{d}" for d in drafters]
    # batch-1 references: specdec plain decoding (== HF greedy) of each prompt alone
    refs = [decoders["none"].generate(p, max_new_tokens=max_new, eos_token_id=eos).generated(0).tolist()
            if "none" in decoders else None for p in prompts[: max(sizes)]]

    def run(m: str, batch: list[torch.Tensor], n: int) -> dict:
        if m == "hf-generate":
            return run_hf(model, batch, n, eos, pad)
        return run_specdec(decoders[m.split(":", 1)[1]], batch, n, eos)

    warm_up(methods, lambda m: run(m, prompts[:2], 4))
    log = None if log_path is None else AnswerFile(log_path, key=("batch", "method"), fresh=True)
    records = []
    for B in sizes:
        batch = prompts[:B]
        runs = {m: [] for m in methods}
        for r in range(repeats):
            for m in rotated(methods, r):
                runs[m].append(run(m, batch, max_new))
        hf_tps = statistics.median(x["tokens"] / x["seconds"] for x in runs["hf-generate"])
        for m in methods:
            xs = runs[m]
            tps = statistics.median(x["tokens"] / x["seconds"] for x in xs)
            rec = {"batch": B, "method": m, "tokens_per_s": tps, "speedup": tps / hf_tps, "hf_tokens_per_s": hf_tps,
                   "first_finished_s": statistics.median(min(x["finish"]) for x in xs),
                   "last_finished_s": statistics.median(max(x["finish"]) for x in xs),
                   "mean_finished_s": statistics.median(statistics.mean(x["finish"]) for x in xs),
                   "tau": statistics.median(x["tau"] for x in xs) if "tau" in xs[0] else None,
                   "split_steps": xs[0].get("split_steps"), "steps": xs[0].get("steps")}
            if xs[0]["rows"] is not None and refs[0] is not None:
                same, gaps = 0, []
                for b, row in enumerate(xs[0]["rows"]):
                    i = first_difference(row, refs[b])
                    if i is None:
                        same += 1
                    else:
                        gaps.append(top2_gap(model, batch[b], refs[b][:i]))
                rec["identical_to_b1"] = f"{same}/{B}"
                rec["max_gap_at_difference"] = max(gaps) if gaps else None
            records.append(rec)
            say(json.dumps(rec))
            if log is not None:
                log.append(rec)
    return records


def run(args) -> int:
    """``specdec bench --batch-size 1,2,4,8,16``: args from specdec.bench.generation's parser."""
    from rich.console import Console
    from rich.table import Table

    from specdec.models import load_model
    from specdec.bench.questions import load_questions

    sizes = list(args.batch_size)  # int_list: positive sizes, checked while parsing
    drafters = list(args.drafters)
    # --packed-drafters / --int8-drafters: the batches run on that target (HF generate on it too), with those
    # drafters; a second target in one batch rotation is not built (say so rather than drop them)
    load_kwargs: dict = {"dtype": MODEL_DTYPES[args.dtype], "weights": "fp32"}
    if args.packed_drafters and args.int8_drafters:
        raise ValueError("--batch-size takes --packed-drafters or --int8-drafters, not both (one target per batch run)")
    if args.packed_drafters or args.int8_drafters:
        drafters = (args.packed_drafters or args.int8_drafters).split(",")
        load_kwargs = {"weights": args.weights, "numerics": "int8" if args.int8_drafters else "exact"}
    if "none" not in drafters:
        drafters.insert(0, "none")  # plain batched decoding on the store: the batch-1 references too
    questions = load_questions(args.questions) if args.questions else load_questions()
    cats = sorted({q.category for q in questions})
    by_cat = {c: [q for q in questions if q.category == c] for c in cats}
    texts = []  # round-robin over categories: every batch mixes tasks (and prompt lengths)
    while len(texts) < max(sizes) and any(by_cat.values()):
        for c in cats:
            if by_cat[c] and len(texts) < max(sizes):
                texts.append(by_cat[c].pop(0).turns[0])
    loaded = load_model(args.model, **load_kwargs)
    kernels.prepare()
    console = Console(width=200)
    out = Path(args.out + "-batch").with_suffix(".jsonl")
    records = bench_batches(loaded.model, loaded.tokenizer, texts, sizes, drafters, args.max_new_tokens,
                            args.repeats, out, say=lambda s: None)
    target = "" if "numerics" not in load_kwargs else f" ({load_kwargs['weights']}, {load_kwargs['numerics']} numerics)"
    table = Table(title=f"{loaded.name}{target}: batched throughput, {args.max_new_tokens} new tokens, greedy, "
                        f"{torch.get_num_threads()} threads (medians of {args.repeats})")
    for col in ("B", "method", "tokens/s", "speedup", "first done s", "last done s", "mean done s", "tau",
                "identical to B=1", "max gap"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["batch"]), r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['first_finished_s']:.1f}", f"{r['last_finished_s']:.1f}", f"{r['mean_finished_s']:.1f}",
                      "-" if r["tau"] is None else f"{r['tau']:.2f}", r.get("identical_to_b1", "-"),
                      "-" if r.get("max_gap_at_difference") is None else f"{r['max_gap_at_difference']:.2e}")
    console.print(table)
    return 0
