"""Prompt lookup: draft the tokens that followed the last time the current n-gram appeared.

Free drafts (no model call), strong where the answer repeats its context: summaries, edits, code,
RAG. After Saxena's prompt-lookup decoding (also HF's ``prompt_lookup_num_tokens``).

HF's version scans the whole text for the suffix n-gram at every step: O(length) per step, paid
even when the controller then drafts nothing. Here each row keeps an ``NgramIndex`` (n-gram -> where its last earlier occurrence
ended), updated per committed token: a lookup is one dict access. ``find_continuation`` is the
scan, kept as the reference the index is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt, TokenHistory
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


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a growing text last occurred with a token after it.

    ``table[n-gram] = j``: the most recent occurrence ends at j and tokens[j] follows it. An n-gram is
    entered only once a token follows it, so the text's own suffix never matches itself: the
    continuation after the suffix is what ``find_continuation`` returns, in O(1) instead of O(length).

    Example: tokens [1 2 3 9 1 2] -> continuation(2) = [3 9 1 2] (after [1 2] at 0), continuation(3) = [].
    """

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        toks, table = self.tokens, self.table
        for t in new:
            j = len(toks)  # the n-grams ending at j now have a token after them
            for n in range(self.min_n, min(self.max_n, j) + 1):
                table[tuple(toks[j - n : j])] = j
            toks.append(t)

    def continuation(self, n: int, max_tokens: int) -> list[int]:
        """What followed the last earlier occurrence of the text's final n tokens (maybe nothing)."""
        toks = self.tokens
        if not self.min_n <= n <= min(self.max_n, len(toks)) or max_tokens <= 0:
            return []
        j = self.table.get(tuple(toks[len(toks) - n :]))
        return [] if j is None else toks[j : j + max_tokens]


class PromptLookupDrafter(Drafter):
    # a propose is a dict lookup and a slice (free); deterministic chains (a one-hot q under sampling)
    capabilities = Capabilities(free_drafts=True, batches=True, samples=True)

    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()) -> None:
        self.config = config
        self.rows: list[NgramIndex] | None = None  # per batch row
        self._matches: list[tuple[int, list[int]]] | None = None  # per row (n-gram size, continuation)

    def begin(self, prompt: Prompt) -> None:
        c = self.config
        self.rows = [NgramIndex(row, c.min_ngram, c.max_ngram) for row in TokenHistory(prompt).rows]
        self._matches = None

    def _match(self, row: NgramIndex) -> tuple[int, list[int]]:
        """The longest suffix n-gram (max_ngram down to min_ngram) seen before, and what followed it."""
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            found = row.continuation(n, self.config.max_draft)
            if found:
                return n, found
        return 0, []

    def draft_class(self) -> int:
        """The n-gram size the next draft copies after (0: no match), the longest over the rows."""
        assert self.rows is not None, "begin() first"
        self._matches = [self._match(row) for row in self.rows]
        return max(n for n, _ in self._matches)

    def propose(self, budget: int) -> DraftTree:
        assert self.rows is not None, "begin() first"
        matches = self._matches if self._matches is not None else [self._match(r) for r in self.rows]
        self._matches = None
        return DraftTree.chains([found[: max(0, budget)] for _, found in matches])

    def accept(self, commit: Commit) -> None:
        for b, row in enumerate(self.rows):
            row.extend(commit.new_tokens(b))
        self._matches = None

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
        self._matches = None
