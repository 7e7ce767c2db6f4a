"""The tiny-model exactness suite, on any device: what `specdec bench-device` checks first on a GPU.

Every case builds tiny random Llama targets on ``device`` and compares specdec with the target's own
output on that device:

    greedy/NAME      batch 1: SpecDecoder(target, NAME's drafter) == target.generate(greedy), token for
                     token, for every drafter kind (copying, a draft model, early exit, EAGLE trees,
                     StreamingLLM / SnapKV compressed KV, suffix trees, auto)
    batch/NAME       a ragged batch of three prompts (each row accepts its own count, rows leave when
                     done): every row == its prompt alone
    sampling/NAME    the first two sampled tokens of many generations follow the target's exact joint
                     distribution (chi-square and TV, specdec.bench.distribution)
    seeded-repeat    the same seed gives the same samples

``static``: every case with the target's steps static (``kv.static``), captured as CUDA graphs on a GPU.

A case returns None when it holds, else a line saying what differed; ``run`` catches a case that
raises and reports the error, so one broken part does not hide the others.

    from specdec.bench.device.exactness import run
    run("cuda")  # -> [{"case": "greedy/none", "passed": True, "detail": "", "seconds": 0.4}, ...]
"""

from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import replace
from typing import Callable

import torch

from specdec.bench.device.tiny import hf_greedy, peaked, perturbed, tiny_llama
from specdec.bench.distribution import pair_mismatch, two_token_tables
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters import LookupHybridDrafter, ModelDrafter, PromptLookupDrafter, Sources, SuffixDrafter
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from specdec.drafters.early_exit import early_exit_model
from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
from specdec.kv.static import StaticShapes
from specdec.sampling import SamplingParams

NEW = 12  # new tokens per greedy generation
SAMPLES = 8_000  # generations per sampling case on an accelerator (the CPU test asks for fewer)
SAMPLE_BATCH = 2_000  # rows per sampling generate call


def _prompt() -> torch.Tensor:
    ids = torch.randint(1, 128, (10,), generator=torch.Generator().manual_seed(0))
    return torch.cat([ids, ids])  # [20]: repeats itself, so copies find matches


def _prompts() -> list[torch.Tensor]:
    ids = _prompt()  # rows of different lengths and texts: each accepts its own number of drafts
    return [ids[:13], ids, torch.cat([ids[3:9], ids[3:9], ids[:4]])]


def _eagle(target) -> EagleDrafter:
    torch.manual_seed(1)  # a randomly initialised head: exact whatever it guesses
    head = EagleHead(target).to(device=target.device, dtype=target.dtype)
    return EagleDrafter(target, head, EagleConfig(total_tokens=6, depth=3, top_k=2))


def _corpus(target) -> list[list[int]]:
    return [hf_greedy(target, _prompt()[None, 5:], 20)[0].tolist(), list(range(40))]


# name -> drafter factory over the target (None: plain decoding on the BMC store)
DRAFTERS: dict[str, Callable] = {
    "none": lambda t: None,
    "prompt-lookup": lambda t: PromptLookupDrafter(),
    "model": lambda t: ModelDrafter(perturbed(t, 0.2)),
    "early-exit": lambda t: ModelDrafter(early_exit_model(t, 1)),
    "eagle": _eagle,
    "eagle+lookup": lambda t: LookupHybridDrafter(_eagle(t)),
    "streaming": lambda t: StreamingDrafter(t, budget=16, sink=2, overshoot=4),
    "snapkv": lambda t: SnapKVDrafter(t, budget=16, window=4, kernel=3, overshoot=4),
    "suffix": lambda t: SuffixDrafter(),
    "suffix-corpus": lambda t: SuffixDrafter.from_corpus(_corpus(t)),
    "auto": lambda t: Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(), "eagle": _eagle(t),
                               "streaming": StreamingDrafter(t, budget=16, sink=2, overshoot=4)},
                              by_match=("eagle",)),
}
BATCHED = ("none", "prompt-lookup", "model", "early-exit", "eagle", "streaming", "suffix", "auto")
SAMPLED = ("model", "eagle", "streaming")


def _greedy_case(name: str, batch: bool, device, config: SpecDecoderConfig) -> str | None:
    target = tiny_llama(7, layers=2, device=device)
    prompts = _prompts() if batch else [_prompt()]
    out = SpecDecoder(target, DRAFTERS[name](target), config).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    for b, p in enumerate(prompts):
        want = hf_greedy(target, p[None], NEW)[0, len(p):].tolist()
        got = out.generated(b).tolist()
        if got != want:
            return f"row {b}: {got} != target.generate {want}"
    return None


_SAMPLING_PROMPT = torch.tensor([[1, 5, 7, 5, 7, 9]])


def _sampling_case(name: str, device, samples: int, config: SpecDecoderConfig) -> str | None:
    target = peaked(0, device=device)
    p1, p2 = two_token_tables(target, _SAMPLING_PROMPT, SamplingParams.resolve(target, temperature=0.8))
    config = replace(config, draft_length=DraftLengthConfig(cost_aware=False))  # draft from step 2 on
    decoder = SpecDecoder(target, DRAFTERS[name](target), config)
    g = torch.Generator().manual_seed(1)
    pairs, drafted, P = [], 0, _SAMPLING_PROMPT.shape[1]
    for _ in range(max(1, samples // SAMPLE_BATCH)):
        rows = min(samples, SAMPLE_BATCH)
        out = decoder.generate(_SAMPLING_PROMPT.expand(rows, -1), max_new_tokens=3, do_sample=True,
                               temperature=0.8, generator=g)
        pairs.append(out.sequences[:, P: P + 2])
        drafted += sum(sum(s.num_drafted) for s in out.steps)
    if drafted == 0:
        return "nothing was drafted: the case tests nothing"
    return pair_mismatch(torch.cat(pairs), p1[:, None].cpu() * p2.cpu())


def _seeded_case(device, config: SpecDecoderConfig) -> str | None:
    target = tiny_llama(7, device=device)
    config = replace(config, draft_length=DraftLengthConfig(cost_aware=False))  # drafts independent of timing
    decoder = SpecDecoder(target, ModelDrafter(perturbed(target, 0.2)), config)
    runs = [decoder.generate(_prompts(), max_new_tokens=NEW, eos_token_id=None, do_sample=True, top_p=0.9,
                             seed=s).sequences for s in (3, 3, 4)]
    if not torch.equal(runs[0], runs[1]):
        return "the same seed gave different samples"
    if torch.equal(runs[0], runs[2]):
        return "another seed gave the same samples"
    return None


def cases(device, samples: int = SAMPLES, static: StaticShapes | None = None) -> dict[str, Callable[[], str | None]]:
    """Every case by name, each a function of nothing returning None or what differed; ``static``: the
    target's steps static (``kv.static``; CUDA graphs on a GPU), else BMC's."""
    config = SpecDecoderConfig(static=static)
    out: dict[str, Callable[[], str | None]] = {}
    for name in DRAFTERS:
        out[f"greedy/{name}"] = lambda n=name: _greedy_case(n, False, device, config)
    for name in BATCHED:
        out[f"batch/{name}"] = lambda n=name: _greedy_case(n, True, device, config)
    for name in SAMPLED:
        out[f"sampling/{name}"] = lambda n=name: _sampling_case(n, device, samples, config)
    out["seeded-repeat"] = lambda: _seeded_case(device, config)
    return out


def run(device, names: list[str] | None = None, samples: int = SAMPLES,
        report: Callable[[dict], None] | None = None, static: StaticShapes | None = None) -> list[dict]:
    """Run the cases ``names`` (default all) on ``device``; one record per case, also handed to
    ``report`` as it finishes: {"case", "passed", "detail", "seconds"} ("steps": "static" with ``static``)."""
    table = cases(device, samples, static)
    unknown = set(names or []) - set(table)
    if unknown:
        raise ValueError(f"unknown exactness cases {sorted(unknown)}; known: {', '.join(table)}")
    records = []
    for name in names or list(table):
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():  # self-speculation over a tiny prompt says it copies it all
                warnings.simplefilter("ignore", UserWarning)
                detail = table[name]()
        except Exception as e:  # a broken part is a failed case, reported with where it broke
            detail = f"{type(e).__name__}: {e} | " + " <- ".join(
                f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(e.__traceback__)[-4:]))
        record = {"case": name, "passed": detail is None, "detail": detail or "",
                  "seconds": round(time.perf_counter() - t0, 3), "steps": "dynamic" if static is None else "static"}
        records.append(record)
        if report is not None:
            report(record)
    return records
