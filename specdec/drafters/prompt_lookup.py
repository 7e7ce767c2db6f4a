"""Prompt lookup: draft the tokens that followed the last time the current n-gram appeared.

Free drafts (no model call), strong where the answer repeats its context: summaries, edits, code,
RAG. After Saxena's prompt-lookup decoding (also HF's ``prompt_lookup_num_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.drafters.base import Commit, Drafter, Prompt, TokenHistory
from specdec.tree import DraftTree


@dataclass(frozen=True)
class PromptLookupConfig:
    max_ngram: int = 3  # longest suffix tried first: longer matches predict better
    min_ngram: int = 1  # shortest suffix worth matching
    max_draft: int = 10  # tokens copied per match, before the decoder's budget caps it


def find_continuation(seq: np.ndarray, ngram: int, max_tokens: int) -> np.ndarray:
    """Tokens after the most recent earlier occurrence of seq's last ``ngram`` tokens (maybe empty).

    Example: seq = [1 2 3 9 1 2], ngram 2 -> suffix [1 2] occurs at 0 -> continuation [3 9 1 ...].
    The most recent match wins: it reflects the text being written right now.
    """
    L = len(seq)
    if L <= ngram or max_tokens <= 0:
        return seq[:0]
    windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], ngram)  # [L - ngram, ngram]
    hits = np.flatnonzero((windows == seq[L - ngram :]).all(axis=1))
    if hits.size == 0:
        return seq[:0]
    start = hits[-1] + ngram
    return seq[start : start + max_tokens]


class PromptLookupDrafter(Drafter):
    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()) -> None:
        self.config = config
        self.history: TokenHistory | None = None
        self._matches: list[tuple[int, np.ndarray]] | None = None  # per row (n-gram size, continuation)

    def begin(self, prompt: Prompt) -> None:
        self.history = TokenHistory(prompt)
        self._matches = None

    def _match(self, row: list[int]) -> tuple[int, np.ndarray]:
        """The longest suffix n-gram (max_ngram down to min_ngram) seen before, and what followed it."""
        seq = np.asarray(row, dtype=np.int64)
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            found = find_continuation(seq, n, self.config.max_draft)
            if found.size:
                return n, found
        return 0, seq[:0]

    def draft_class(self) -> int:
        """The n-gram size the next draft copies after (0: no match), the longest over the rows."""
        assert self.history is not None, "begin() first"
        self._matches = [self._match(row) for row in self.history.rows]
        return max(n for n, _ in self._matches)

    def propose(self, budget: int) -> DraftTree:
        assert self.history is not None, "begin() first"
        matches = self._matches if self._matches is not None else [self._match(r) for r in self.history.rows]
        self._matches = None
        drafts = [found[: max(0, budget)] for _, found in matches]
        width = max(len(d) for d in drafts)
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.from_numpy(d)
        num = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        return DraftTree.chain(tokens, num)

    def accept(self, commit: Commit) -> None:
        self.history.extend(commit)
        self._matches = None

    def select(self, rows: list[int]) -> None:
        self.history.select(rows)
        self._matches = None
