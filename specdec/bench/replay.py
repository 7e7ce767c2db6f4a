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

    @property
    def tau(self) -> float:
        return self.tokens / max(1, self.steps)


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


def replay(drafter: Drafter, prompt: list[int], answer: list[int], budget: int = 10) -> ReplayStats:
    """One generation of ``answer`` after ``prompt``, batch 1; ``budget`` caps each draft (for
    drafters that follow the controller; self-sized ones get the tokens still wanted)."""
    if not answer:
        return ReplayStats(0, 0, 0)
    drafter.begin(Prompt(torch.tensor([prompt]), torch.tensor([len(prompt)])))
    pos, steps, nodes = 1, 1, 0  # the prefill's forward gives answer[0]
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
    return ReplayStats(len(answer), steps, nodes)


def _ranges(text: str) -> list[int]:
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
    p.add_argument("--held-out", default="100-129,500-519", help="line indices replayed (greedy answers only)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    docs = read_token_jsonl(args.answers)
    held = _ranges(args.held_out)
    held_prompts = {docs[i].ids[: docs[i].prompt_len] for i in held}
    # the corpus leaves out every conversation with a held-out prompt (sampled answers to it too)
    corpus = SuffixCorpus(d for d in docs if d.ids[: d.prompt_len] not in held_prompts)
    drafters = {"suffix": lambda: SuffixDrafter(), "suffix-corpus": lambda: SuffixDrafter(corpus=corpus),
                "prompt-lookup": lambda: PromptLookupDrafter()}
    for name, make in drafters.items():
        total = [0, 0, 0]
        for i in held:
            d = docs[i]
            s = replay(make(), list(d.ids[: d.prompt_len]), list(d.ids[d.prompt_len:][: args.max_new_tokens]))
            total = [total[0] + s.tokens, total[1] + s.steps, total[2] + s.nodes]
        st = ReplayStats(*total)
        print(f"{name:14s} tau {st.tau:.2f}  drafted nodes per step {st.nodes / st.steps:.1f}  "
              f"({len(held)} answers, {st.tokens} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
