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

    def begin(self, prompt: Prompt) -> None:
        self.history = TokenHistory(prompt)

    def propose(self, budget: int) -> DraftTree:
        assert self.history is not None, "begin() first"
        k = min(budget, self.config.max_draft)
        drafts = []
        for row in self.history.rows:
            seq = np.asarray(row, dtype=np.int64)
            found = seq[:0]
            for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
                found = find_continuation(seq, n, k)
                if found.size:
                    break
            drafts.append(found)
        width = max(len(d) for d in drafts)
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.from_numpy(d)
        num = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        return DraftTree.chain(tokens, num)

    def accept(self, commit: Commit) -> None:
        self.history.extend(commit)
