"""A small model drafts a chain of K tokens with its own BMC KV store, rolled back on rejection."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt, TokenHistory
from specdec.forward import forward_block
from specdec.introspect import vocab_size_of
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.runtime import kernels
from specdec.sampling import SamplingParams, draw, target_probs
from specdec.tree import DraftTree


@dataclass(frozen=True)
class ModelDrafterConfig:
    bmc: BMCConfig = BMCConfig(period=64)  # the draft model's own store


class ModelDrafter(Drafter):
    """Any HF causal LM sharing the target's vocabulary drafts a chain, one token per forward:
    greedily, or, when the decoder samples (``Prompt.sampling``), by sampling each token from the
    draft model's distribution processed like the target's (same temperature / top-k / top-p),
    with ``Prompt.generator``; that distribution is handed over as ``DraftTree.probs`` [B, K, V].

    State between steps: the draft store holds rows for committed tokens ``[0, cache_len)``; the
    committed tokens after that (one or two per step) are *pending* and are fed first next time.
    Drafts d1..d(K-1) are written speculatively; accept() rolls the store back to the rows whose
    tokens the target kept.
    """

    capabilities = Capabilities(batches=True, samples=True)  # controller-sized chains

    def __init__(self, draft_model, config: ModelDrafterConfig = ModelDrafterConfig()) -> None:
        self.model = draft_model.eval()
        self.config = config
        self.vocab_size = vocab_size_of(draft_model)
        self.cache: BMCCache | None = None
        self.history: TokenHistory | None = None
        self._fed: list[int] = []  # per row: committed tokens in the store before the last propose
        self._drafted = 0  # drafted tokens written into the store by the last propose (K - 1)
        self._proposed = False  # a propose ran since the last accept (the decoder may skip it)
        self._catch_up = self._resume = 0.0  # seconds of the last propose (catch_up_seconds, resume_seconds)
        self.sampling: SamplingParams | None = None  # from the prompt; None = greedy drafts
        self.generator: torch.Generator | None = None

    def torch_modules(self) -> list:
        return [self.model]

    def catch_up_seconds(self) -> float:
        return self._catch_up

    def resume_seconds(self) -> float:
        return self._resume

    def begin(self, prompt: Prompt) -> None:
        self.history = TokenHistory(prompt)
        B = prompt.input_ids.shape[0]
        self.cache = BMCCache.for_model(self.model, B, self.config.bmc)
        self._fed = [0] * B
        self._drafted = 0
        self.sampling, self.generator = prompt.sampling, prompt.generator

    def _feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Append ragged token rows to the store as chains; logits [B, V] after each row's last."""
        B, Q = len(rows), max(len(r) for r in rows)
        ids = torch.zeros(B, Q, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        out = forward_block(self.model, self.cache, ids, None, None)  # causal: right padding is unseen
        self.cache.commit([list(range(len(r))) for r in rows])
        last = torch.tensor([len(r) - 1 for r in rows], device=out.logits.device)
        return out.logits[torch.arange(B), last]  # [B, V]

    def propose(self, budget: int) -> DraftTree:
        B = len(self.history.rows)
        self._fed = list(self.cache.lengths)
        self._drafted = 0
        self._proposed = True
        self._catch_up = self._resume = 0.0
        if budget <= 0:
            return DraftTree.empty(B)
        pending = [row[n:] for row, n in zip(self.history.rows, self._fed)]
        # a step leaves at most its last draft and the target's token unfed; more is a catch-up (the prompt
        # at an answer's first draft, or the text of a pause), not this draft's price (decision 010)
        behind = max(len(p) for p in pending) > 2
        t0 = time.perf_counter()
        logits = self._feed(pending)
        if behind:
            self._catch_up = time.perf_counter() - t0
            self._resume = 0.0 if max(self._fed) == 0 else self._catch_up
        probs: list[torch.Tensor] = []  # [B, V] each, when sampling
        drafts = [self._pick(logits, probs)]  # [B] each
        for _ in range(budget - 1):
            logits = self._feed([[t] for t in drafts[-1].tolist()])
            drafts.append(self._pick(logits, probs))
        self._drafted = budget - 1
        q = torch.stack(probs, dim=1) if probs else None  # [B, K, V] when sampling
        return DraftTree.chain(torch.stack(drafts, dim=1).cpu(), probs=q)

    def _pick(self, logits: torch.Tensor, probs: list) -> torch.Tensor:
        return pick_token(logits, probs, self.sampling, self.generator)

    def select(self, rows: list[int]) -> None:
        self.history.select(rows)
        self.cache.select(rows)
        self._fed = [self._fed[b] for b in rows]

    def accept(self, commit: Commit) -> None:
        self.history.extend(commit)
        self._catch_up = self._resume = 0.0
        if not self._proposed:  # nothing was written since the last accept: nothing to roll back
            return
        self._proposed = False
        # Keep the pending rows plus the drafted rows whose tokens were accepted: d1..d(K-1) were
        # fed, d_K never was. Example: 1 pending, K = 4, 2 accepted -> keep fed + 1 + 2 rows.
        keep = []
        for b, n_acc in enumerate(commit.num_accepted.tolist()):
            pending = self.cache.lengths[b] - self._fed[b] - self._drafted
            keep.append(self._fed[b] + pending + min(n_acc, self._drafted))
        self.cache.rollback(keep)


def pick_token(logits: torch.Tensor, probs: list, sampling: SamplingParams | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """A chain drafter's next token per row from logits [B, V]: argmax (greedy), or a sample from the
    distribution processed as the target's is, which is appended to ``probs`` (on the logits' device,
    where the verifier reads q; the uniforms come from ``generator``, a CPU one)."""
    if sampling is None:
        return kernels.argmax(logits)
    q = target_probs(logits[:, None], sampling)[:, 0]  # [B, V] float64
    probs.append(q)
    return draw(q, generator)
