"""BMC: a KV cache that grows T padded rows at a time, with speculated rows written in place.

After "BMC: Accelerating LLM inference via Balanced Memory and Compute" (iterative allocation copies
the cache every step, upfront allocation attends over a full-length buffer; BMC allocates T rows at a
time and lets speculative tokens use the padding).

Per layer the store keeps K/V buffers [B, H, C, D] (a view of the first B of R >= B batch rows: room
for rows joining a server's batch) whose capacity C is a multiple of T. Each batch row
b has its own committed length ``lengths[b]``. One target forward writes its Q new rows (pending
token + draft nodes) at rows ``lengths[b] + [0, Q)`` of every layer and attends over a *view* of the
first ``max(lengths) + Q`` rows, never the whole buffer. When that view would pass C, the buffer is
reallocated once with room rounded up to the next multiple of T: one copy every ~T tokens, not one
per token as a torch.cat cache does.

Unused rows are hidden by an additive bias mask (0 = visible, dtype-min = hidden) built by
``prepare``. ``commit`` then keeps the accepted rows of each block as a contiguous prefix; every row
after a sequence's length is padding again and is overwritten by the next write.

Worked example, one row, T = 4, committed length 5, block Q = 3 (pending p, drafts a, b)::

    rows      0 1 2 3 4 | 5 6 7 | (8 = padding, capacity 8)
    content   c c c c c | p a b |
    bias      0 0 0 0 0   visible per the tree mask
    verify accepts a only -> commit keeps block rows [0, 1] -> length 7; row 7 (b) is padding.

It plugs into any HF model through transformers' ``Cache`` interface: the model calls
``update(k, v, layer_idx)`` per layer; the caller passes the 4D bias from ``prepare`` as
``attention_mask`` and explicit ``position_ids`` (see ``specdec.decoder``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.introspect import text_config
from specdec.kv.blocks import BlockInputs, WritePlan, block_bias, causal, causal_bias
from specdec.quant.numerics import kv_dtype


@dataclass(frozen=True)
class BMCConfig:
    period: int = 64  # T: rows added per reallocation; copy cost ~ N^2/T, padded compute ~ N*T

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"BMC period T must be >= 1, got {self.period}")


class BMCLayer(CacheLayerMixin):
    """One layer's K/V buffers. All bookkeeping lives in the owning ``BMCCache``."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, store: "BMCCache", layer_idx: int) -> None:
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        # the whole buffers [R, H, C, D] (R >= B batch rows) whose first B rows ``keys`` / ``values`` view;
        # every buffer this layer holds comes through ``adopt`` (None before the first)
        self._room_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self._buffer_dtype(key_states), key_states.device
        self.is_initialized = True

    def _buffer_dtype(self, states: torch.Tensor) -> torch.dtype:
        """What this layer's buffers hold: the store's ``kv_dtype`` (written rounded to it), else the states' own."""
        return self.store.kv_dtype or states.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, H, Q, D]
        plan = self.store._plan
        assert plan is not None, "BMCCache.prepare() must run before each forward"
        B, H, Q, D = key_states.shape
        assert Q == plan.q and B == len(plan.starts), f"block {B}x{Q} != planned {len(plan.starts)}x{plan.q}"
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if plan.end > self.capacity:
            self._grow(plan.end, key_states, value_states)
        if plan.row_index is None:
            s = plan.starts[0]
            self.keys[:, :, s : s + Q] = key_states
            self.values[:, :, s : s + Q] = value_states
        else:
            idx_k = plan.row_index[:, None, :, None].expand(B, H, Q, D)
            self.keys.scatter_(2, idx_k, key_states.to(self.keys.dtype))
            self.values.scatter_(2, plan.row_index[:, None, :, None].expand_as(value_states),
                                 value_states.to(self.values.dtype))
        # Attend over a view of the rows in use, not the whole padded buffer (the view is what makes
        # BMC match a sliced preallocation; a masked full buffer costs ~2x at long lengths).
        return self.keys[:, :, : plan.end], self.values[:, :, : plan.end]

    def _grow(self, needed: int, k: torch.Tensor, v: torch.Tensor) -> None:
        store = self.store
        if self.layer_idx == 0 and store.period_policy is not None:  # layer 0 grows first: it sets T
            store.set_period(store.period_policy(store.max_length))
        self.resize(math.ceil(needed / store.period) * store.period, k, v, k.shape[0])
        if self.layer_idx == 0:
            self.store.num_allocations += 1

    # -- buffers with room for batch rows: the live rows are a view of the first B, so rows that
    # leave are compacted in place and rows that join are copied into the room, where a server's
    # batch would otherwise reallocate (and fragment the C heap) at every join and leave

    @property
    def batch_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def room_rows(self) -> int:
        """Batch rows the buffers hold (live rows and spare room)."""
        return 0 if self._room_kv is None else self._room_kv[0].shape[0]

    def resize(self, capacity: int, like_k: torch.Tensor, like_v: torch.Tensor, rows: int,
               dtype: torch.dtype | None = None) -> None:
        """Buffers of ``capacity`` rows keeping the committed rows (``reshape``); where there are none yet,
        zeros for ``rows`` batch rows with the heads, width and device of ``like_k`` / ``like_v`` [*, H, *, D],
        in ``dtype`` (default: ``_buffer_dtype``'s)."""
        if self.keys is not None:
            self.reshape(self.room_rows, capacity)
            return
        H, Dk, Dv = like_k.shape[1], like_k.shape[-1], like_v.shape[-1]
        dtype = self._buffer_dtype(like_k) if dtype is None else dtype
        self.adopt(torch.zeros(rows, H, capacity, Dk, dtype=dtype, device=like_k.device),
                   torch.zeros(rows, H, capacity, Dv, dtype=dtype, device=like_v.device), rows)
        self.dtype, self.device, self.is_initialized = dtype, like_k.device, True

    def reshape(self, room: int, capacity: int) -> None:
        """New buffers of ``room`` batch rows x ``capacity`` rows holding the live rows' committed rows,
        their padding zeros (it must be finite: a masked row still enters q.k^T and weights * V). The
        spare rows are left untouched (no pages until a join writes them; ``append`` zeroes their padding)."""
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[-1]
        keep = min(self.store.max_length, capacity)  # rows worth copying: everything past is padding
        rk = torch.empty(room, H, capacity, Dk, dtype=self.keys.dtype, device=self.keys.device)
        rv = torch.empty(room, H, capacity, Dv, dtype=self.values.dtype, device=self.values.device)
        rk[:B, :, :keep] = self.keys[:, :, :keep]
        rv[:B, :, :keep] = self.values[:, :, :keep]
        rk[:B, :, keep:].zero_()
        rv[:B, :, keep:].zero_()
        self.adopt(rk, rv, B)

    def adopt(self, rk: torch.Tensor, rv: torch.Tensor, rows: int) -> None:
        """Hold buffers [R, H, C, D]; the first ``rows`` batch rows are the live ones."""
        self._room_kv = (rk, rv)
        self.keys, self.values = rk[:rows], rv[:rows]

    def load_prefix(self, b: int, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Write a prefill's K/V [H, P, D] as batch row b's first P rows (buffers made on first use)."""
        with torch.inference_mode():
            if self.keys is None:
                B, (H, _, Dk), Dv = self.store.batch_size, keys.shape, values.shape[-1]
                self.dtype, self.device = self._buffer_dtype(keys), keys.device
                self.is_initialized = True
                # zeros, not empty: padding must be finite (see reshape)
                self.adopt(torch.zeros(B, H, capacity, Dk, dtype=self.dtype, device=keys.device),
                            torch.zeros(B, H, capacity, Dv, dtype=self.dtype, device=values.device), B)
            self.keys[b, :, : keys.shape[1]] = keys
            self.values[b, :, : values.shape[1]] = values

    def select(self, rows: list[int]) -> None:
        """Keep batch rows ``rows`` (ascending) only: finished sequences leave. Rows move down in place
        (their committed rows only)."""
        room = self._room_kv
        if room is None:
            return
        with torch.inference_mode():
            keep = self.store.max_length  # before the select: covers every moving row
            for i, r in enumerate(rows):  # r >= i: a row is read before any write reaches it
                if r != i:
                    room[0][i, :, :keep] = room[0][r, :, :keep]
                    room[1][i, :, :keep] = room[1][r, :, :keep]
            self.adopt(*room, len(rows))

    def append(self, other: "BMCLayer") -> None:
        """Add ``other``'s batch rows after this layer's: copied into the room when it has enough batch
        rows and capacity, else into new buffers of the larger capacity (made with no spare room)."""
        B, n = self.batch_rows, other.batch_rows
        C = max(self.capacity, other.capacity)
        with torch.inference_mode():
            if self.room_rows < B + n or self.capacity < C:
                self.reshape(B + n, C)
            room = self._room_kv
            P = other.store.max_length
            for mine, theirs in zip(room, (other.keys, other.values)):
                mine[B : B + n, :, :P] = theirs[:, :, :P]
                mine[B : B + n, :, P:].zero_()  # a spare row may never have been written (see reshape)
        self.adopt(*room, B + n)

    def gather_rows(self, src: torch.Tensor, dst: torch.Tensor, batch: torch.Tensor) -> None:
        """Move rows ``src`` to rows ``dst`` of batch rows ``batch`` (all [M]); reads happen first."""
        with torch.inference_mode():  # buffers made under inference mode only change inside it
            self._gather(src, dst, batch)

    def _gather(self, src: torch.Tensor, dst: torch.Tensor, batch: torch.Tensor) -> None:
        self.keys[batch, :, dst] = self.keys[batch, :, src]
        self.values[batch, :, dst] = self.values[batch, :, src]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.max_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.max_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self._room_kv = None
        self.is_initialized = False


class BMCCache(Cache):
    """The BMC KV store for one generation: per-row committed lengths, T-row growth, bias masks."""

    layer_class = BMCLayer  # what holds each layer's buffers

    def __init__(self, num_layers: int, batch_size: int, config: BMCConfig = BMCConfig(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.dtype = dtype  # the forward's: its bias masks'
        self.kv_dtype = kv_dtype  # the buffers' (written rounded to it); None: the states' own
        self.device = torch.device(device)
        self.lengths: list[int] = [0] * batch_size  # committed rows per batch row (host copy: no syncs)
        self.num_allocations = 0  # reallocations so far (counted once for all layers)
        self.period = config.period  # T now (``set_period``); starts at the config's
        # asked at every reallocation with the rows held, returns T for it (specdec.controller.period: T grows
        # with the sequence); None keeps T fixed
        self.period_policy = None
        self._plan: WritePlan | None = None
        super().__init__(layers=[self.layer_class(self, i) for i in range(num_layers)])

    @classmethod
    def for_model(cls, model, batch_size: int, config: BMCConfig = BMCConfig()) -> "BMCCache":
        """A store for ``model``'s K/V in the dtype its numerics keeps them in (``quant.numerics.kv_dtype``)."""
        return cls(text_config(model).num_hidden_layers, batch_size, config, model.dtype, model.device,
                   kv_dtype(model))

    def set_period(self, period: int) -> None:
        """Grow by ``period`` rows from the next reallocation on (rows held stay where they are)."""
        if period < 1:
            raise ValueError(f"BMC period T must be >= 1, got {period}")
        self.period = int(period)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def prepare(self, block_mask: torch.Tensor, depth: torch.Tensor) -> BlockInputs:
        """Plan the next forward over a block of Q rows per batch row and build its inputs.

        block_mask: [B, Q, Q] bool, which block rows each block row sees (causal for a chain, the
        ancestor mask for a tree). depth: [B, Q] offset of each row's position from the row's start
        (0, 1, 2, ... for a chain; tree depth for a tree). Committed rows are always visible.
        """
        return self._prepare_block(block_mask, depth)

    def _prepare_block(self, block_mask: torch.Tensor, depth: torch.Tensor) -> BlockInputs:
        """``prepare`` itself, never overridden (``prepare_chain``'s ragged path calls it)."""
        B, Q, _ = block_mask.shape
        assert B == self.batch_size, f"block batch {B} != cache batch {self.batch_size}"
        assert depth.shape == (B, Q), f"depth {tuple(depth.shape)} != {(B, Q)}"
        block_mask = block_mask.to(self.device)  # drafters build trees where they like (the host, mostly)
        self._plan = plan = WritePlan(self.lengths, Q, self.device)
        starts = torch.tensor(self.lengths, device=self.device)  # [B]
        bias = block_bias(starts, block_mask, plan.end, self.dtype)
        position_ids = starts[:, None] + depth.to(self.device)
        return BlockInputs(position_ids, bias)

    def prepare_chain(self, q: int) -> BlockInputs:
        """``prepare`` for a causal block (a chain draft, a prefill, a plain decode step): the hot path.

        With equal lengths in every row (always so at B = 1) the bias is zeros over the committed
        rows and a causal triangle over the block, built without index work: at one token per step
        the whole block costs two small allocations instead of ~10 mask ops.
        """
        B = self.batch_size
        if len(set(self.lengths)) != 1:  # ragged rows: the general path (never a subclass's prepare:
            # CompressedCache shifts the positions of both, and through its prepare it shifted twice)
            return self._prepare_block(causal(q, self.device).expand(B, q, q), torch.arange(q).expand(B, q))
        self._plan = plan = WritePlan(self.lengths, q, self.device)
        s, L = self.lengths[0], plan.end
        bias = torch.zeros(1, 1, q, L, dtype=self.dtype, device=self.device)
        if q > 1:
            bias[0, 0, :, s:] = causal_bias(q, self.dtype, self.device)
        position_ids = torch.arange(s, s + q, device=self.device)[None]
        return BlockInputs(position_ids.expand(B, q), bias.expand(B, 1, q, L))

    def direct_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None:
        """For a forward that writes its block and attends by itself (the lean forward's one compiled
        call, ``csrc/layers.cpp``): every layer's K/V buffers [B, H, C, D], grown now to hold the planned
        block, and each batch row's first block row (the block goes to rows start .. start + Q, as
        ``update`` writes it); None if a layer is not a plain BMC layer or has no buffers yet (its
        ``update`` then does the work)."""
        plan = self._plan
        assert plan is not None, "BMCCache.prepare() must run before each forward"
        if any(type(layer) is not BMCLayer or layer.keys is None for layer in self.layers):
            return None
        for layer in self.layers:
            if plan.end > layer.capacity:
                layer._grow(plan.end, layer.keys, layer.values)
        return [layer.keys for layer in self.layers], [layer.values for layer in self.layers], plan.starts

    def commit(self, keep: list[list[int]]) -> None:
        """Keep block rows ``keep[b]`` (in order) of the last forward as batch row b's new rows.

        Example: start 7, keep [0, 2, 5] -> rows 9 and 12 move to rows 8 and 9; length 7 -> 10.
        A chain keeps a prefix [0, 1, ..., a] that is already in place: no copy at all.
        """
        plan = self._plan
        assert plan is not None and len(keep) == self.batch_size
        src, dst, bat = [], [], []
        for b, rows in enumerate(keep):
            assert all(0 <= r < plan.q for r in rows), f"keep {rows} outside a block of {plan.q}"
            s = plan.starts[b]
            for j, r in enumerate(rows):
                if r != j:
                    src.append(s + r)
                    dst.append(s + j)
                    bat.append(b)
            self.lengths[b] = s + len(rows)
        if src:
            t = lambda xs: torch.tensor(xs, device=self.device)  # noqa: E731
            for layer in self.layers:
                layer.gather_rows(t(src), t(dst), t(bat))
        self._plan = None

    def load_prefill(self, b: int, layers: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> None:
        """Batch row b's prompt K/V, computed elsewhere (a prefill run alone on the causal fast path):
        per layer (keys, values) [H, P, D]; the row's length becomes P. ``capacity`` sizes the buffers
        when they are made (the longest prompt of the batch, rounded up to a multiple of T)."""
        assert len(layers) == len(self.layers), f"{len(layers)} layers of K/V for a {len(self.layers)}-layer store"
        capacity = math.ceil(capacity / self.period) * self.period
        for layer, (k, v) in zip(self.layers, layers):
            layer.load_prefix(b, k, v, capacity)
        self.lengths[b] = layers[0][0].shape[1]
        if self.num_allocations == 0:
            self.num_allocations = 1

    def select(self, rows: list[int]) -> None:
        """Keep only batch rows ``rows`` (ascending): the finished sequences' rows are dropped, so no
        later forward computes them (compaction, not masking). Example: lengths [5, 9, 7], rows [0, 2]
        -> lengths [5, 7]; the attended view shrinks to 7 + Q rows."""
        assert self._plan is None, "select() between forwards only"
        for layer in self.layers:
            layer.select(rows)
        self.lengths = [self.lengths[b] for b in rows]
        self._fit_buffers()

    def _fit_buffers(self) -> None:
        """After rows left: a long sequence gone, buffers far longer than the rows still held shrink (memory
        stays bounded by the live rows, not by the longest sequence the batch ever held)."""
        fit = (math.ceil(self.max_length / self.period) + 1) * self.period
        if self.capacity > 2 * fit:
            with torch.inference_mode():
                for layer in self.layers:
                    layer.reshape(layer.room_rows, fit)
            self.num_allocations += 1

    def append(self, other: "BMCCache") -> None:
        """Add ``other``'s batch rows after this store's (sequences joining a running batch, prefilled
        in a store of their own): copied into this store's room for batch rows where it fits, else
        both into new buffers (``BMCLayer.append``). Example: lengths [5, 9] + [7] -> [5, 9, 7];
        capacities 64 and 128 -> 128 for every row."""
        assert self._plan is None and other._plan is None, "append() between forwards only"
        assert len(other.layers) == len(self.layers), "stores of different models"
        for layer, theirs in zip(self.layers, other.layers):
            layer.append(theirs)
        self.lengths = self.lengths + other.lengths

    def rollback(self, lengths: list[int]) -> None:
        """Shorten each row to ``lengths[b]`` committed rows; the rows after become padding."""
        assert len(lengths) == self.batch_size
        for b, n in enumerate(lengths):
            assert 0 <= n <= self.lengths[b], f"row {b}: cannot roll back {self.lengths[b]} rows to {n}"
        self.lengths = list(lengths)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.max_length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.max_length + query_length, 0
