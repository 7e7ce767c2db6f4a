"""Replay: a text drafter's tau and speed on stored greedy answers, without running the model.

A greedy answer is what the target emits whatever it was drafted with (lossless), so the accepted
length of each draft is the longest path of its tree that spells the stored continuation, and the
step then adds that path plus the target's next token -- exactly the decoder's step, with the stored
answer standing in for the target's argmax. Good for drafters that read only tokens (suffix, prompt
lookup): their tau (tokens per target forward, as Spec-Bench counts it) in seconds, with no
timing noise. Drafts are sized as the decoder sizes them (``decoder.draft_step``, ``learn_step``),
under a fixed setting (``--settings k=10``, the default: every draft verified, chains of 10, trees
whole; ``n=8``: trees of 8 nodes) or the controller (``controller``), which then reads each step's
verify cost from ``--verify-curve`` (in plain steps; its drafts cost nothing). Timing noise and the
run-to-run drift of a shared machine are absent, so two budget rules compare on the same answers to
the digit; what a replay leaves out (draft and controller seconds, a store's growth) a timed
``specdec bench`` keeps. It assumes the stored answers are greedy answers of the target.

    python -m specdec.bench.replay --held-out 100-129,500-519 --max-new-tokens 256
      suffix (no corpus), suffix (corpus = the other stored conversations), prompt lookup
    specdec bench --questions ../shared/specbench/question.jsonl --per-category 3 --max-new-tokens 256 \
        --no-hf-lookup --drafters none --save-answers results/answers.jsonl
    specdec bench-verify --in-decoder --tree --context 300 --repeats 3 --sizes 1,2,...,17 --out results/curve.json
    python -m specdec.bench.replay --answers results/answers.jsonl --held-out all \
        --corpus data/eagle_answers.jsonl --verify-curve results/curve.json --drafters suffix-corpus \
        --settings controller,n=4,n=6,n=8,n=16
      the target's own answers to Spec-Bench questions, the project's stored answers as the corpus:
      the tree-size controller against fixed node budgets on this machine's verify curve

With ``--verify-curve`` (a step's cost per verified rows in plain steps, "1:1,8:1.28,16:1.63", linear
in between, or ``specdec bench-verify --in-decoder --out``'s JSON) it also prints tokens per plain
step's time, the speed the drafts give.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.bench.runner import fixed_setting
from specdec.arguments import positive_int
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.decoder import StepOutcome, draft_step, learn_step
from specdec.drafters.base import Commit, Drafter, Prompt
from specdec.drafters.chooser import Chooser, as_chooser
from specdec.tree import path_along


@dataclass(frozen=True)
class ReplayStats:
    tokens: int  # answer tokens replayed
    steps: int  # target forwards the decoder would have run (the prefill included)
    nodes: int  # drafted nodes verified over all steps
    cost: float = 0.0  # those forwards' time in plain steps, by a verify curve (0: none given)

    @property
    def tau(self) -> float:
        return self.tokens / max(1, self.steps)

    def __add__(self, other: "ReplayStats") -> "ReplayStats":
        return ReplayStats(self.tokens + other.tokens, self.steps + other.steps, self.nodes + other.nodes,
                           self.cost + other.cost)


def step_cost(curve: dict[int, float], rows: int) -> float:
    """A verify of ``rows`` rows in plain steps, linear between the curve's sizes (flat past its ends).
    Example: {1: 1.0, 8: 1.28} -> 4 rows: 1.12."""
    sizes = sorted(curve)
    if rows <= sizes[0]:
        return curve[sizes[0]]
    for a, b in zip(sizes, sizes[1:]):
        if rows <= b:
            return curve[a] + (curve[b] - curve[a]) * (rows - a) / (b - a)
    return curve[sizes[-1]]


def replay(drafter: Drafter | Chooser, prompt: list[int], answer: list[int], budget: int = 10,
           curve: dict[int, float] | None = None, controller: DraftLengthController | None = None,
           on_step: Callable[[int, int], None] | None = None) -> ReplayStats:
    """One generation of ``answer`` after ``prompt``, batch 1; ``curve``: verify cost per rows
    (``step_cost``), to price each step. Drafts are sized by ``controller`` as the decoder sizes them
    (``decoder.draft_step``; it learns from each step, ``decoder.learn_step``, priced by the curve in
    plain steps, drafts free): pass the same controller for a session's answers, as a decoder keeps
    its own. Without one, every draft is verified: ``budget`` caps a chain drafter's, a self-sized
    tree drafter gets the tokens still wanted. ``on_step(nodes, accepted)`` hears every decode step."""
    if not answer:
        return ReplayStats(0, 0, 0)
    if controller is None:
        controller = DraftLengthController(fixed_setting(f"k={budget}").draft_length)
    if controller.config.cost_aware and not curve:
        raise ValueError("the controller prices drafts by verify times: give a verify curve")
    controller.new_run(1)
    drafter = as_chooser(drafter)  # drafted as the decoder drafts: through a chooser
    drafter.begin(Prompt(torch.tensor([prompt]), torch.tensor([len(prompt)])))
    pos, steps, nodes = 1, 1, 0  # the prefill's forward gives answer[0]
    cost = 1.0 if curve else 0.0  # the prefill counted as one forward, as tau counts it
    drafter.accept(Commit(torch.tensor([answer[:1]]), torch.tensor([1]), torch.tensor([0])))
    while pos < len(answer):
        wanted = len(answer) - pos - 1
        key, tree, shadows = draft_step(drafter, controller, 1, wanted, shadow=True)
        n = int(tree.num_nodes[0]) if tree.tokens.shape[1] else 0
        parents, tokens = (tree.parents[0, :n].tolist(), tree.tokens[0, :n].tolist()) if n else ([], [])
        path = path_along(parents, tokens, answer[pos:])
        new = answer[pos: pos + len(path) + 1]
        seconds = step_cost(curve, 1 + n) if curve else None
        learn_step(controller, StepOutcome(key, tree, [path], seconds, 0.0 if curve else None, shadows, [new]))
        drafter.accept(Commit(torch.tensor([new]), torch.tensor([len(new)]), torch.tensor([len(path)])))
        if on_step is not None:
            on_step(n, len(path))
        pos, steps, nodes = pos + len(new), steps + 1, nodes + n
        cost += seconds or 0.0
    return ReplayStats(len(answer), steps, nodes, cost)


def _ranges(text: str, n: int) -> list[int]:
    """Line indices: "100-129,500-519", or "all" (0 .. n - 1)."""
    if text == "all":
        return list(range(n))
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def read_curve(text: str) -> dict[int, float]:
    """A verify curve in plain steps: "ROWS:COST,..." pairs, or a JSON file written by ``specdec
    bench-verify --in-decoder --out`` (its seconds per block size, over the 1-row step's). Raises
    ValueError naming what is wrong. Example: "1:1,8:1.28" -> {1: 1.0, 8: 1.28}."""
    if text.endswith(".json"):
        with open(text) as f:
            data = json.load(f)
        seconds = data.get("seconds") if isinstance(data, dict) else None
        if not isinstance(seconds, dict) or "1" not in seconds:
            raise ValueError(f"{text}: no 'seconds' per block size with a 1-row step (bench-verify --out)")
        curve = {int(q): float(t) / float(seconds["1"]) for q, t in seconds.items()}
    else:
        try:
            curve = {int(r): float(c) for r, c in (part.split(":") for part in text.split(","))}
        except ValueError:
            raise ValueError(f"ROWS:COST pairs, comma-separated, e.g. 1:1,8:1.28 (got {text!r})") from None
    if not curve or min(curve) < 1 or min(curve.values()) <= 0:
        raise ValueError(f"rows >= 1 and costs > 0 (got {text!r})")
    return curve


def _parser() -> argparse.ArgumentParser:
    from specdec.drafters.suffix import default_answers_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--answers", default=str(default_answers_path()), help="token-id JSONL of greedy answers")
    p.add_argument("--held-out", default="100-129,500-519",
                   help="line indices of --answers replayed (greedy answers only), or 'all'")
    p.add_argument("--corpus", default=None,
                   help="token-id JSONL the suffix drafter searches (default: --answers minus the held-out "
                        "prompts' conversations)")
    p.add_argument("--verify-curve", default=None, metavar="ROWS:COST,...|FILE.json",
                   help="verify cost per rows in plain steps (e.g. 1:1,8:1.28,16:1.63), or bench-verify "
                        "--in-decoder --out's JSON: prints speed too")
    p.add_argument("--drafters", default="suffix,suffix-corpus,prompt-lookup", help="comma-separated")
    p.add_argument("--settings", default="k=10", metavar="SETTING,...",
                   help="'controller' (needs --verify-curve), k=N (chains of N; trees whole) or n=N (trees "
                        "of N nodes): each drafter is replayed under each")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    return p


def _settings(p: argparse.ArgumentParser, settings: str,
              curve: dict[int, float] | None) -> dict[str, DraftLengthConfig]:
    """``--settings`` as draft-length configurations by name; a bad one ends the command (``p.error``)."""
    configs: dict[str, DraftLengthConfig] = {}
    for setting in settings.split(","):
        if setting == "controller":
            if curve is None:
                p.error("--settings controller: the controller prices drafts by verify times; give --verify-curve")
            configs[setting] = DraftLengthConfig()
        else:
            try:
                configs[setting] = fixed_setting(setting).draft_length
            except ValueError as e:
                p.error(f"--settings: {e}")
    return configs


def main(argv: list[str] | None = None) -> int:
    from specdec.drafters.prompt_lookup import PromptLookupDrafter
    from specdec.drafters.suffix import SuffixCorpus, SuffixDrafter, read_token_jsonl

    p = _parser()
    args = p.parse_args(argv)
    curve = None
    if args.verify_curve:
        try:
            curve = read_curve(args.verify_curve)
        except (ValueError, OSError) as e:
            p.error(f"--verify-curve: {e}")
    configs = _settings(p, args.settings, curve)
    docs = read_token_jsonl(args.answers)
    held = _ranges(args.held_out, len(docs))
    held_prompts = {docs[i].ids[: docs[i].prompt_len] for i in held}
    # the corpus leaves out every conversation with a held-out prompt (sampled answers to it too)
    source = read_token_jsonl(args.corpus) if args.corpus else docs
    corpus = SuffixCorpus(d for d in source if d.ids[: d.prompt_len] not in held_prompts)
    makers = {"suffix": lambda: SuffixDrafter(), "suffix-corpus": lambda: SuffixDrafter(corpus=corpus),
              "prompt-lookup": lambda: PromptLookupDrafter()}
    names = args.drafters.split(",")
    if unknown := [n for n in names if n not in makers]:
        p.error(f"--drafters: unknown {', '.join(unknown)} (known: {', '.join(makers)})")
    for name in names:
        for setting, config in configs.items():
            # one controller over the session's answers, as one decoder keeps its own
            controller, st = DraftLengthController(config), ReplayStats(0, 0, 0)
            for i in held:
                d = docs[i]
                st = st + replay(makers[name](), list(d.ids[: d.prompt_len]),
                                 list(d.ids[d.prompt_len:][: args.max_new_tokens]), curve=curve,
                                 controller=controller)
            speed = f"  tokens per plain step's time {st.tokens / st.cost:.3f}" if curve else ""
            print(f"{name:14s} {setting:10s} tau {st.tau:.2f}  drafted nodes per step {st.nodes / st.steps:.1f}  "
                  f"({len(held)} answers, {st.tokens} tokens){speed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
