"""The grammar's own drafts: where a constraint allows only one way on (a JSON key, punctuation, a
forced literal), those tokens are proposed as a chain, free to make and accepted unless the target
writes the same text in other tokens.

    SpecDecoder(target, Sources({"grammar": GrammarDrafter(), "lookup": PromptLookupDrafter()}))

It reads each row's grammar state from ``Prompt.processors`` (the decoder advances them); rows without
a grammar, or where it forces nothing, draft nothing, and a step where no row has a forced token has
no draft of this class (``draft_class`` 0), so beside other sources (``auto``) it drafts only where the
grammar decides the text and they draft elsewhere.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt
from specdec.tree import DraftTree

LOOKAHEAD = 32  # forced tokens asked of the grammar at most (a key and its punctuation are a few)


class GrammarDrafter(Drafter):
    capabilities = Capabilities(free_drafts=True, batches=True, samples=True)

    def __init__(self) -> None:
        self.processors: list = []

    def begin(self, prompt: Prompt) -> None:
        self.processors = list(prompt.processors or [None] * len(prompt.lengths))

    def _forced(self, limit: int) -> list[list[int]]:
        return [p.forced(limit) if p is not None else [] for p in self.processors]

    def draft_class(self):
        """The longest forced run of any row, up to 2 (0: nothing forced anywhere: no draft)."""
        return min(2, max((len(f) for f in self._forced(2)), default=0))

    def propose(self, budget: int) -> DraftTree:
        forced = [f[:budget] for f in self._forced(min(budget, LOOKAHEAD))]
        K = max((len(f) for f in forced), default=0)
        tokens = torch.zeros(len(forced), K, dtype=torch.long)
        for b, f in enumerate(forced):
            tokens[b, : len(f)] = torch.tensor(f, dtype=torch.long)
        return DraftTree.chain(tokens, torch.tensor([len(f) for f in forced], dtype=torch.long))

    def accept(self, commit: Commit) -> None:
        """Nothing to learn: the grammar states are the decoder's, advanced with the commit."""

    def select(self, rows: list[int]) -> None:
        self.processors = [self.processors[b] for b in rows]
