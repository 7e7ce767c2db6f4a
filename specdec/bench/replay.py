"""Replay: a text drafter's tau on stored greedy answers, without running the model.

A greedy answer is what the target emits whatever it was drafted with (lossless), so the accepted
length of each draft is the longest path of its tree that spells the stored continuation, and the
step then adds that path plus the target's next token -- exactly the decoder's step, with the stored
answer standing in for the target's argmax. Good for drafters that read only tokens (suffix, prompt
lookup): their tau (tokens per target forward, as Spec-Bench counts it) in seconds, with no
timing noise. It assumes the draft of every step is verified (no controller gating: the decoder's
``cost_aware=False``) and that the stored answers are greedy answers of the target.

    python -m specdec.bench.replay --held-out 100-129,500-519 --max-new-tokens 256
      suffix (no corpus), suffix (corpus = the other stored conversations), prompt lookup
    specdec bench --questions ../shared/specbench/question.jsonl --per-category 3 --max-new-tokens 256 \
        --no-hf-lookup --drafters none --save-answers results/answers.jsonl
    python -m specdec.bench.replay --answers results/answers.jsonl --held-out all \
        --corpus data/eagle_answers.jsonl --verify-curve 1:1,2:1.08,4:1.11,8:1.28,16:1.63
      the target's own answers to Spec-Bench questions, the project's stored answers as the corpus

With ``--verify-curve`` (a step's cost per verified rows, in plain steps, e.g. from ``specdec
bench-verify --in-decoder``; linear in between) it also prints tokens per plain step's time, the
speed the drafts would give if every one were verified.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specdec.drafters.base import Commit, Drafter, Prompt


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


def accepted_along(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Drafted tokens accepted when the target's greedy continuation is ``truth``: the deepest path
    from the root whose tokens spell truth's prefix (siblings are distinct, so the walk is unique).

    Example: tokens [3, 4, 5], parents [-1, 0, -1], truth [3, 4, 9] -> 2.
    """
    node, a = -1, 0
    while a < len(truth):
        node = next((j for j, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[a]), None)
        if node is None:
            break
        a += 1
    return a


def replay(drafter: Drafter, prompt: list[int], answer: list[int], budget: int = 10,
           curve: dict[int, float] | None = None) -> ReplayStats:
    """One generation of ``answer`` after ``prompt``, batch 1; ``budget`` caps each draft (for
    drafters that follow the controller; self-sized ones get the tokens still wanted); ``curve``:
    verify cost per rows (``step_cost``), to price each step."""
    if not answer:
        return ReplayStats(0, 0, 0)
    drafter.begin(Prompt(torch.tensor([prompt]), torch.tensor([len(prompt)])))
    pos, steps, nodes = 1, 1, 0  # the prefill's forward gives answer[0]
    cost = 1.0 if curve else 0.0  # the prefill counted as one forward, as tau counts it
    drafter.accept(Commit(torch.tensor([answer[:1]]), torch.tensor([1]), torch.tensor([0])))
    while pos < len(answer):
        wanted = len(answer) - pos - 1
        drafter.draft_class()
        cap = min(budget, wanted) if drafter.follows_controller else wanted
        tree = drafter.propose(cap) if cap > 0 else None
        n = 0 if tree is None else int(tree.num_nodes[0])
        a = 0 if n == 0 else accepted_along(tree.tokens[0, :n].tolist(), tree.parents[0, :n].tolist(), answer[pos:])
        new = answer[pos: pos + a + 1]
        drafter.accept(Commit(torch.tensor([new]), torch.tensor([len(new)]), torch.tensor([a])))
        pos, steps, nodes = pos + len(new), steps + 1, nodes + n
        cost += step_cost(curve, 1 + n) if curve else 0.0
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


def main(argv: list[str] | None = None) -> int:
    from specdec.drafters.prompt_lookup import PromptLookupDrafter
    from specdec.drafters.suffix import SuffixCorpus, SuffixDrafter, default_answers_path, read_token_jsonl

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--answers", default=str(default_answers_path()), help="token-id JSONL of greedy answers")
    p.add_argument("--held-out", default="100-129,500-519",
                   help="line indices of --answers replayed (greedy answers only), or 'all'")
    p.add_argument("--corpus", default=None,
                   help="token-id JSONL the suffix drafter searches (default: --answers minus the held-out "
                        "prompts' conversations)")
    p.add_argument("--verify-curve", default=None, metavar="ROWS:COST,...",
                   help="verify cost per rows in plain steps (e.g. 1:1,8:1.28,16:1.63): prints speed too")
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    curve = None
    if args.verify_curve:
        try:
            curve = {int(r): float(c) for r, c in (part.split(":") for part in args.verify_curve.split(","))}
        except ValueError:
            p.error(f"--verify-curve: ROWS:COST pairs, comma-separated, e.g. 1:1,8:1.28 (got {args.verify_curve!r})")
        if not curve or min(curve) < 1 or min(curve.values()) <= 0:
            p.error(f"--verify-curve: rows >= 1 and costs > 0 (got {args.verify_curve!r})")
    docs = read_token_jsonl(args.answers)
    held = _ranges(args.held_out, len(docs))
    held_prompts = {docs[i].ids[: docs[i].prompt_len] for i in held}
    # the corpus leaves out every conversation with a held-out prompt (sampled answers to it too)
    source = read_token_jsonl(args.corpus) if args.corpus else docs
    corpus = SuffixCorpus(d for d in source if d.ids[: d.prompt_len] not in held_prompts)
    drafters = {"suffix": lambda: SuffixDrafter(), "suffix-corpus": lambda: SuffixDrafter(corpus=corpus),
                "prompt-lookup": lambda: PromptLookupDrafter()}
    for name, make in drafters.items():
        st = ReplayStats(0, 0, 0)
        for i in held:
            d = docs[i]
            st = st + replay(make(), list(d.ids[: d.prompt_len]), list(d.ids[d.prompt_len:][: args.max_new_tokens]),
                             curve=curve)
        speed = f"  tokens per plain step's time {st.tokens / st.cost:.2f}" if curve else ""
        print(f"{name:14s} tau {st.tau:.2f}  drafted nodes per step {st.nodes / st.steps:.1f}  "
              f"({len(held)} answers, {st.tokens} tokens){speed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
