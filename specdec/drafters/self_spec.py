"""Self-speculation (MagicDec): the target drafts for itself, reading a compressed copy of its KV.

    StreamingDrafter(target, budget=512, sink=4)           attention sinks + the recent window
    SnapKVDrafter(target, budget=512, window=32, kernel=7)  prompt rows the last queries attend to

Each step the draft is the target's own forward, one token at a time, against a ``CompressedCache``
of ``budget`` rows per KV head (plus up to ``overshoot`` rows between compactions, and the step's
draft rows): a chain of K tokens, greedy, or sampled from its distribution processed as the
target's when the decoder samples (q handed to the verifier). At long contexts a decode step is bound by reading the KV
cache, so reading a few hundred rows instead of thousands makes the draft cheap, and being the
target it is accepted often.

With ``vocab`` (``drafters.vocab``) the draft's output layer computes the frequent ids and the prompt's
only: it never proposes another id, and its q is zero there.

No second prefill, no drift. The compressed cache is copied from the target's store right after its
prefill (``Prompt.cache``). Between steps it holds exactly the *target's* K/V rows of every committed
token it keeps: ``accept`` drops the rows the draft wrote (the pending token and the drafts) and
copies the rows the target just committed from the target's store. The pending token (the last
committed one) is not in the target's store yet, so the draft computes its row at the next propose,
and that row is replaced by the target's one step later.

Degenerate budgets: a prompt of at most ``budget`` tokens is copied whole (a warning says the draft
then reads as much as the target, so it cannot be cheaper); it is compressed like any other once the
generation grows past the budget. A budget below ``sink + 1`` (StreamingLLM) or below 1 is refused.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from specdec.controller.cost import shortest_paying_prompt
from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt
from specdec.drafters.model import pick_token
from specdec.drafters.vocab import DraftVocabulary, VocabHead
from specdec.forward import cache_arg, forward_block
from specdec.introspect import attention_shape, float_dtype
from specdec.kv.bmc import BMCCache
from specdec.quant.numerics import kv_dtype
from specdec.runtime import int8_linear
from specdec.sampling import SamplingParams
from specdec.kv.compressed import (CompressedCache, CompressedCacheConfig, StoreView, group_scores, snapkv_keep,
                                   streaming_keep)
from specdec.tree import DraftTree


class SelfSpecDrafter(Drafter):
    """The shared loop; a subclass only says which prompt rows the draft keeps (``prompt_rows``). The
    draft forward is the target's own, or ``draft_model``'s: a model of the same shape and positions
    (the target's layers quantized, ``drafters.quant_self``) reading the target's rows in the store."""

    # controller-sized chains, sampled with q; drafts by the int8 route where the weights are quantized
    capabilities = Capabilities(batches=True, samples=True, approximate_forwards=True)
    compresses = True  # the draft reads fewer rows than the target (a prompt within the budget: a warning)

    def __init__(self, target, cache_config: CompressedCacheConfig, draft_model=None,
                 vocab: DraftVocabulary | None = None) -> None:
        self.target = target
        self.draft = target if draft_model is None else draft_model.eval()
        self.cache_config = cache_config
        self.vocab = vocab  # the ids the draft's output layer computes (with each prompt's); None: all
        self._head: VocabHead | None = None  # this prompt's: built at begin
        self.num_layers, self.num_kv_heads, self.head_dim = attention_shape(target)
        self.cache: CompressedCache | None = None
        self.source: BMCCache | None = None  # the target's store (read only)
        self._synced: list[int] = []  # per row: target rows already copied (= target.lengths after accept)
        self._pending: torch.Tensor | None = None  # [B, 1] the last committed token, not in any store yet
        self._before_propose: list[int] | None = None  # draft slots in use before the last propose
        self.sampling: SamplingParams | None = None
        self.generator: torch.Generator | None = None

    def pays_from(self, max_ratio: float, batch_size: int = 1) -> int:
        """The shortest prompt at which a draft token reads at most ``max_ratio`` of the bytes a target
        step reads (the weights once, and per sequence the compressed rows against every row:
        ``controller.cost.shortest_paying_prompt``; docs/decisions/008-auto-sources.md)."""
        # parameters and buffers: a quantized target's weights are its blocks, held as buffers
        weights = sum(t.numel() * t.element_size() for t in (*self.target.parameters(), *self.target.buffers()))
        element = (kv_dtype(self.target) or float_dtype(self.target)).itemsize  # the store's rows
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * element * batch_size
        budget = self.cache_config.budget + self.cache_config.overshoot // 2  # between compactions: +32 on average
        return shortest_paying_prompt(weights, per_token, budget, max_ratio)

    def torch_modules(self) -> list:
        return [] if self.draft is self.target else [self.draft]  # the target's modules: the decoder routes them

    @abstractmethod
    def prompt_rows(self, prompt: Prompt, source: BMCCache) -> tuple[list[torch.Tensor], list[int]]:
        """Per row b, the prompt positions the draft keeps, [layers, H, n_b], and how many leading
        slots eviction must never drop."""

    def begin(self, prompt: Prompt) -> None:
        if not isinstance(prompt.cache, BMCCache):
            raise ValueError(f"{type(self).__name__} needs the target's KV store (Prompt.cache) from the decoder")
        self.source = prompt.cache
        self.sampling, self.generator = prompt.sampling, prompt.generator  # None: greedy chains
        lengths = prompt.lengths.tolist()
        budget = self.cache_config.budget
        if self.compresses and any(n <= budget for n in lengths):
            warnings.warn(f"{type(self).__name__}: prompt of {min(lengths)} tokens fits the budget of {budget} "
                          "rows: the draft copies the whole cache (no cheaper than the target until it grows)",
                          stacklevel=2)
        B = len(lengths)
        dtype = float_dtype(self.draft, self.source.dtype)  # the draft's: a quantized copy computes in fp32
        self.cache = CompressedCache(self.num_layers, B, self.cache_config, dtype, self.source.device,
                                     kv_dtype(self.draft))  # bf16 where the draft attends in int8 numerics
        keep, protected = self.prompt_rows(prompt, self.source)
        self.cache.load(self.source, keep, protected)
        self._synced = list(self.source.lengths)
        self._pending = None
        self._before_propose = None
        if self.vocab is not None:
            self._head = VocabHead(self.draft.get_output_embeddings(), self.vocab.ids_for(prompt.input_ids))

    def propose(self, budget: int) -> DraftTree:
        B = self.cache.batch_size
        if budget <= 0 or self._pending is None:  # no pending token before the first accept
            return DraftTree.empty(B)
        self._before_propose = list(self.cache.lengths)
        ids = self._pending  # [B, 1]
        drafts, probs = [], []  # probs: q [B, V] per drafted token when sampling
        # the draft's own forwards: blocks of one or two rows may round x to int8 (int8_linear.approximate; the
        # verify that follows is the target's exact forward)
        with int8_linear.approximate():
            for _ in range(budget):  # feed pending, d1, ..., d(K-1); d(K) is never fed
                out = forward_block(self.draft, self.cache, ids, None, None, head=self._head)
                self.cache.commit([[0]] * B)
                ids = pick_token(out.logits[:, -1], probs, self.sampling, self.generator)[:, None]  # [B, 1]
                drafts.append(ids)
        return DraftTree.chain(torch.cat(drafts, dim=1).cpu(), probs=torch.stack(probs, 1) if probs else None)

    def accept(self, commit: Commit) -> None:
        last = (commit.num_new - 1).clamp(min=0)
        new_pending = commit.tokens.gather(1, last[:, None])  # [B, 1]
        finished = commit.num_new == 0  # a finished row keeps its pending token
        if self._pending is not None:
            new_pending = torch.where(finished[:, None], self._pending.cpu(), new_pending)
        self._pending = new_pending.to(self.source.device)
        if self._before_propose is not None:  # drop the draft's own rows: pending token + drafts
            self.cache.rollback(self._before_propose)
            self._before_propose = None
        self.cache.append(self.source, self._synced)  # the target's rows of the tokens it committed
        self._synced = list(self.source.lengths)
        self.cache.evict()

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self._synced = [self._synced[b] for b in rows]
        if self._pending is not None:
            self._pending = self._pending[rows]
        if self._before_propose is not None:
            self._before_propose = [self._before_propose[b] for b in rows]


class StreamingDrafter(SelfSpecDrafter):
    """StreamingLLM: the first ``sink`` tokens and the most recent ``budget - sink``."""

    def __init__(self, target, budget: int = 512, sink: int = 4, overshoot: int = 64,
                 vocab: DraftVocabulary | None = None) -> None:
        if sink < 0 or budget < sink + 1:
            raise ValueError(f"streaming budget {budget} must be at least sink + 1 = {sink + 1} rows")
        super().__init__(target, CompressedCacheConfig(budget=budget, overshoot=overshoot), vocab=vocab)
        self.sink = sink

    def prompt_rows(self, prompt: Prompt, source: BMCCache) -> tuple[list[torch.Tensor], list[int]]:
        budget, L, H = self.cache_config.budget, self.num_layers, self.num_kv_heads
        keep = [streaming_keep(n, self.sink, budget).expand(L, H, -1) for n in source.lengths]
        return keep, [self.sink] * len(keep)


@dataclass(frozen=True)
class SnapKVConfig:
    window: int = 32  # observation window: the last prompt queries that vote (SnapKV's default)
    kernel: int = 7  # pooling kernel over positions (odd)


class SnapKVDrafter(SelfSpecDrafter):
    """SnapKV: each layer's KV heads keep the prompt positions the last ``window`` queries attend to
    most (pooled, summed per GQA group), plus the window; decoded tokens append, and past the budget
    the oldest decoded rows are evicted (the selected prompt rows stay)."""

    def __init__(self, target, budget: int = 512, window: int = 32, kernel: int = 7, overshoot: int = 64,
                 vocab: DraftVocabulary | None = None) -> None:
        if budget < 1:
            raise ValueError(f"snapkv budget must be at least 1 row, got {budget}")
        if window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"snapkv needs window >= 1 and an odd kernel >= 1, got window {window}, kernel {kernel}")
        super().__init__(target, CompressedCacheConfig(budget=budget, overshoot=overshoot), vocab=vocab)
        self.snap = SnapKVConfig(window, kernel)

    def prompt_rows(self, prompt: Prompt, source: BMCCache) -> tuple[list[torch.Tensor], list[int]]:
        budget, L, H = self.cache_config.budget, self.num_layers, self.num_kv_heads
        lengths = source.lengths
        w = min(self.snap.window, min(lengths))
        votes = observe_window(self.target, source, prompt.input_ids, lengths, w) if max(lengths) > budget else None
        keep, protected = [], []
        for b, n in enumerate(lengths):
            if n <= budget:
                keep.append(torch.arange(n).expand(L, H, n))
                protected.append(max(0, budget - min(self.snap.window, budget)))
                continue
            rows = [snapkv_keep(votes[l][b], n, budget, w, self.snap.kernel) for l in range(L)]
            keep.append(torch.stack(rows))  # [layers, H, budget]
            protected.append(budget - min(w, budget))  # the selected prompt rows stay; the window slides
        return keep, protected


# ---------------------------------------------------------------------------------------------
# SnapKV's observation window without a second prefill.

OBSERVE = "specdec_observe"


def _observe_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, snapkv_votes=None,
                       **kwargs):
    """Eager attention that also records, per KV head, how much the block's queries attend to each
    key: query [B, Hq, w, D], key/value [B, H, L, D] -> votes[layer] [B, H, L]."""
    B, Hq, w, D = query.shape
    H = key.shape[1]
    # query head q reads KV head q // (Hq / H); a store in bf16 (int8 numerics) read in the query's dtype
    k = key.to(query.dtype).repeat_interleave(Hq // H, dim=1)
    v = value.to(query.dtype).repeat_interleave(Hq // H, dim=1)
    logits = torch.matmul(query, k.transpose(2, 3)) * scaling + attention_mask  # [B, Hq, w, L]
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if snapkv_votes is not None:
        snapkv_votes[module.layer_idx] = group_scores(weights.sum(2), H)  # [B, H, L]
    out = torch.matmul(weights.to(v.dtype), v).transpose(1, 2).contiguous()  # [B, w, Hq, D]
    return out, None


AttentionInterface.register(OBSERVE, _observe_attention)


@torch.inference_mode()
def observe_window(model, store: BMCCache, input_ids: torch.Tensor, lengths: list[int], window: int) -> list:
    """One forward of ``model`` over each row's last ``window`` prompt tokens, attending to the
    store's rows (read only, never written), recording the attention votes: per layer [B, H, L].

    Row b's window holds positions [n_b - w, n_b) and sees the store's rows up to its own position.
    Example: n = (6, 4), w = 2, L = 6 -> row 0 queries 4, 5; row 1 queries 2, 3 (sees cols 0..3).
    """
    B = len(lengths)
    L = max(lengths)
    n = torch.tensor(lengths)[:, None]  # [B, 1]
    positions = n - window + torch.arange(window)  # [B, w]
    ids = input_ids.gather(1, positions)  # [B, w]
    dtype = store.dtype
    visible = torch.arange(L)[None, None, :] <= positions[:, :, None]  # [B, w, L]
    bias = torch.zeros(B, 1, window, L, dtype=dtype)
    bias.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    votes: dict[int, torch.Tensor] = {}
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = OBSERVE  # this forward only; restored below whatever happens
    try:
        model(input_ids=ids.to(model.device), position_ids=positions.to(model.device),
              attention_mask=bias.to(model.device), use_cache=True, **{cache_arg(model): StoreView(store, L)},
              logits_to_keep=1, snapkv_votes=votes)
    finally:
        config._attn_implementation = saved
    return [votes[i] for i in range(len(votes))]
