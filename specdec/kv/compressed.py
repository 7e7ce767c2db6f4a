"""Compressed KV caches for self-speculation: the target reads a few hundred of its own KV rows.

MagicDec (Chen et al., 2024): at long contexts decoding is bound by loading the KV cache, so the
target itself, attending over a small cache, is a cheap draft that is accepted often. Two rules
choose which rows of the target's cache the draft keeps:

- StreamingLLM (Xiao et al., 2023): the first S *sink* tokens and the last W tokens (budget S + W).
- SnapKV (Li et al., 2024): at the prefill, the last ``window`` prompt queries vote for the prompt
  positions they attend to; votes are pooled with a 1-D kernel (a position next to a hot one is
  kept too), summed over the query heads of each GQA group, and each KV head of each layer keeps
  its own top positions, plus the window itself.

Storage. ``CompressedCache`` is a ``BMCCache`` whose rows are *slots*, not positions: slot j of a
head may hold any position (each SnapKV head keeps its own), and the slots in use are the same
count for every head, so one additive bias [B, 1, Q, L] still hides the unused ones. Keys are stored
already rotated (RoPE) at their true positions, and new queries are given their true positions
(slot + ``shift[b]``), so every query-key distance the draft sees is the true one; only the rows
in between are missing. Worked example, one row, sink 2, budget 5, 9 committed tokens::

    positions kept  0 1 | 6 7 8        slots 0..4, shift = 9 - 5 = 4
    next token      position 9 = slot 5 + shift 4

Eviction is amortised as BMC allocation is: a row may overshoot its budget by ``overshoot`` slots;
then one gather keeps its protected head (sinks, or SnapKV's selected prompt rows) and its most
recent slots, back to the budget. Not a copy per step.

The selection rules are pure functions below (tested on hand-made scores); the caches only copy rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.kv.blocks import BlockInputs
from specdec.kv.bmc import BMCCache, BMCConfig

# ---------------------------------------------------------------------------------------------
# Selection rules (pure). L = rows of a cache, H = KV heads, Hq = query heads, n = rows kept.


def streaming_keep(length: int, head: int, budget: int) -> torch.Tensor:
    """Rows to keep of ``length``: the first ``head`` (attention sinks) and the last
    ``budget - head``, ascending. All rows when ``length <= budget``.

    Example: length 10, head 2, budget 5 -> [0, 1, 7, 8, 9].
    """
    if not 0 <= head < budget:
        raise ValueError(f"need 0 <= head < budget, got head {head}, budget {budget}")
    if length <= budget:
        return torch.arange(length)
    tail = budget - head
    return torch.cat([torch.arange(head), torch.arange(length - tail, length)])


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[..., L] -> [..., L]: the mean over a centred window of ``kernel`` positions (odd; zero
    padding at the ends, as SnapKV's avg_pool1d). A hot position lends its score to its neighbours,
    so a kept token keeps the tokens around it (a word's pieces, a phrase).

    Example: kernel 3, [0, 3, 0, 0] -> [1, 1, 1, 0].
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd and >= 1, got {kernel}")
    if kernel == 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])  # [N, 1, L]
    pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return pooled.reshape(shape)


def group_scores(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, L] per query head -> [B, H, L] per KV head: the sum over each GQA group.

    Query head q reads KV head q // (Hq / H) (HF's repeat_kv order). Example: Hq 4, H 2 ->
    KV head 0 gets query heads 0 + 1, KV head 1 gets 2 + 3.
    """
    B, Hq, L = scores.shape
    if Hq % num_kv_heads:
        raise ValueError(f"{Hq} query heads do not split into {num_kv_heads} KV-head groups")
    return scores.reshape(B, num_kv_heads, Hq // num_kv_heads, L).sum(2)


def snapkv_keep(votes: torch.Tensor, length: int, budget: int, window: int, kernel: int) -> torch.Tensor:
    """Rows each KV head keeps: its top ``budget - w`` prompt positions by pooled votes, then the
    last ``w = min(window, budget)`` positions (the observation window, always kept); [H, n] ascending.

    votes: [H, L >= length] the observation window's attention per KV head (summed over its
    queries and its GQA group). All rows when ``length <= budget``. Example: length 8, budget 4,
    window 2, head 0 votes peak at position 1 -> head 0 keeps [0, 1, 6, 7] or [1, 2, 6, 7].
    """
    H, dev = votes.shape[0], votes.device
    if length <= budget:
        return torch.arange(length, device=dev).expand(H, length)
    w = min(window, budget)
    candidates = length - w  # positions before the window compete for the other slots
    recent = torch.arange(candidates, length, device=dev).expand(H, w)
    k = budget - w
    if k == 0:
        return recent
    pooled = pool_scores(votes[:, :length].float(), kernel)[:, :candidates]  # [H, candidates]
    top = pooled.topk(k, dim=-1).indices.sort(dim=-1).values  # [H, k]
    return torch.cat([top, recent], dim=-1)


# ---------------------------------------------------------------------------------------------
# The compressed store.


@dataclass(frozen=True)
class CompressedCacheConfig:
    budget: int = 512  # rows per KV head a row holds after each compaction
    overshoot: int = 64  # rows past the budget before one compaction (one gather per ~64 tokens)
    period: int = 64  # BMC growth step of the slot buffers

    def __post_init__(self) -> None:
        if self.budget < 1 or self.overshoot < 0:
            raise ValueError(f"need budget >= 1 and overshoot >= 0, got {self.budget}, {self.overshoot}")


class CompressedCache(BMCCache):
    """A BMC store of slots (see the module doc): per-row lengths, budgets, position shifts.

    Per batch row b: ``lengths[b]`` slots in use, ``shift[b]`` = true position of slot 0 of the
    next block minus ``lengths[b]``, ``protected[b]`` leading slots eviction never drops (sinks or
    SnapKV's selected prompt rows), ``budgets[b]`` slots left after a compaction.
    """

    def __init__(self, num_layers: int, batch_size: int, config: CompressedCacheConfig = CompressedCacheConfig(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_layers, batch_size, BMCConfig(config.period), dtype, device, kv_dtype)
        self.limits = config
        self.shift: list[int] = [0] * batch_size
        self.protected: list[int] = [0] * batch_size
        self.budgets: list[int] = [config.budget] * batch_size
        self.num_compactions = 0

    # -- blocks: BMC's bias over slots, true positions -------------------------------------------
    def prepare(self, block_mask: torch.Tensor, depth: torch.Tensor) -> BlockInputs:
        return self._true_positions(super().prepare(block_mask, depth))

    def prepare_chain(self, q: int) -> BlockInputs:
        return self._true_positions(super().prepare_chain(q))

    def _true_positions(self, inputs: BlockInputs) -> BlockInputs:
        shift = torch.tensor(self.shift, device=self.device)[:, None]  # [B, 1]
        return BlockInputs(inputs.position_ids + shift, inputs.attention_mask)

    def next_positions(self) -> list[int]:
        """Per row, the true position the next block starts at."""
        return [n + s for n, s in zip(self.lengths, self.shift)]

    # -- filling from the target's store ---------------------------------------------------------
    @torch.inference_mode()  # the target's buffers are inference tensors
    def load(self, source: BMCCache, keep: list[torch.Tensor], protected: list[int]) -> None:
        """Fill every row from the target's store: row b's head h of layer l gets source rows
        ``keep[b][l, h]`` ([layers, H, n_b] positions) in slots [0, n_b). Row b then continues at
        position ``source.lengths[b]``."""
        assert len(keep) == self.batch_size == source.batch_size
        counts = [int(k.shape[-1]) for k in keep]
        self._allocate(source, max(counts) + self.limits.overshoot)
        for l, (dst, src) in enumerate(zip(self.layers, source.layers)):
            for b, idx in enumerate(keep):
                rows = idx[l].to(src.keys.device)[:, :, None]  # [H, n, 1]
                dst.keys[b, :, : counts[b]] = src.keys[b].gather(1, rows.expand(-1, -1, src.keys.shape[-1]))
                dst.values[b, :, : counts[b]] = src.values[b].gather(1, rows.expand(-1, -1, src.values.shape[-1]))
        self.lengths = counts
        self.shift = [int(n) - c for n, c in zip(source.lengths, counts)]
        self.protected = list(protected)

    @torch.inference_mode()
    def append(self, source: BMCCache, starts: list[int]) -> None:
        """Append source rows [starts[b], source.lengths[b]) of each row after its slots in use: the
        target's own K/V for tokens it has just committed (no drift from the draft's K/V)."""
        stops = source.lengths
        counts = [e - s for s, e in zip(starts, stops)]
        assert all(c >= 0 for c in counts), f"source rows {stops} behind {starts}"
        if not any(counts):
            return
        self._allocate(source, max(n + c for n, c in zip(self.lengths, counts)))
        for dst, src in zip(self.layers, source.layers):
            for b, (s, c) in enumerate(zip(starts, counts)):
                n = self.lengths[b]
                # a few rows per step per layer: slice copies, no index tensors
                dst.keys[b, :, n : n + c] = src.keys[b, :, s : s + c]
                dst.values[b, :, n : n + c] = src.values[b, :, s : s + c]
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def _allocate(self, source: BMCCache, needed: int) -> None:
        """Make every layer hold at least ``needed`` slots, keeping the slots in use (BMC growth)."""
        if needed <= self.capacity:
            return
        cap = math.ceil(needed / self.period) * self.period
        for dst, src in zip(self.layers, source.layers):
            # padding zeros (a masked row still enters q.k^T), in this store's dtype (a draft's may differ)
            dst.resize(cap, src.keys, src.values, self.batch_size, self.kv_dtype or self.dtype)
        self.num_allocations += 1

    # -- eviction --------------------------------------------------------------------------------
    @torch.inference_mode()
    def evict(self) -> None:
        """Compact each row that overshot its budget by more than ``overshoot``: keep its protected
        head and its most recent slots, ``budgets[b]`` in all; later positions shift accordingly."""
        src, dst, bat = [], [], []
        for b, n in enumerate(self.lengths):
            budget = self.budgets[b]
            if n <= budget + self.limits.overshoot:
                continue
            keep = streaming_keep(n, self.protected[b], budget)
            moved = keep[self.protected[b]:]  # the head stays in place
            src.append(moved)
            dst.append(torch.arange(self.protected[b], budget))
            bat.append(torch.full((len(moved),), b))
            self.shift[b] += n - budget
            self.lengths[b] = budget
        if src:
            s, d, bb = (torch.cat(x).to(self.device) for x in (src, dst, bat))
            for layer in self.layers:
                layer.gather_rows(s, d, bb)
            self.num_compactions += 1

    # -- batches ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        """Keep batch rows ``rows`` (finished sequences leave): one gather per buffer."""
        for layer in self.layers:
            layer.select(rows)
        for name in ("lengths", "shift", "protected", "budgets"):
            setattr(self, name, [getattr(self, name)[b] for b in rows])


# ---------------------------------------------------------------------------------------------
# A read-only view of the target's store, for SnapKV's observation forward.


class _ViewLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, source, length: int) -> None:
        super().__init__()
        self.source, self.length = source, length
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never lazy
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # The window's own rows are already in the store (the prefill wrote them): its recomputed
        # K/V (equal up to rounding) are dropped, and nothing is copied or written.
        return self.source.keys[:, :, : self.length], self.source.values[:, :, : self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class StoreView(Cache):
    """The first ``length`` rows of a BMC store as a cache that is never written: a forward over
    rows already in the store (SnapKV's observation window) reads them without touching them."""

    def __init__(self, source: BMCCache, length: int) -> None:
        super().__init__(layers=[_ViewLayer(layer, length) for layer in source.layers])
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.length, 0
