"""A BMC store for static-shape steps: buffers that stay put, blocks of a few fixed sizes.

A captured CUDA graph replays the kernels it recorded on the addresses and sizes it recorded. A target
step can be captured once and replayed every step only if (1) every tensor it reads or writes sits
where it sat at capture, (2) every value that changes between steps (the rows' lengths, the block's
tree) reaches it through such a tensor, never as a host number, and (3) its shapes are the recorded
ones. ``BMCCache`` breaks all three on purpose (it is the CPU's fast store): its attended view of
max(lengths) + Q rows widens every step, it writes at host offsets, its buffers move every T rows.

``StaticCache`` keeps BMC's layout and rules (each row's committed prefix, the block written after it,
an additive bias, ``commit`` by gather, ``select`` / ``append`` for a server's batch) and changes three
things:
- its capacity C is fixed when it is made (the prompt, the answer and the largest block, rounded up to
  ``StaticShapes.capacity_step``); it grows only when a sequence outlives it (a server's), and every
  move of its buffers drops the graphs captured on the old ones;
- a forward attends over all C rows (the bias hides what is not its own) and writes its block by a
  scatter at a row index computed on the device from the rows' starts;
- a block of Q rows runs as a block of ``StaticShapes.bucket(Q)`` rows (``forward.forward_block`` pads
  it): a graph per (batch rows, bucket), not per Q.

Worked example, one row, start 5, a chain of Q = 3 padded to a bucket of 4::

    block rows     p a b | x        x: a pad row (token 0, depth 0)
    written at     5 6 7 | 8        row 8 is padding: hidden from every later row until a block overwrites it
    row x sees     rows 0..4 and itself; its logits are dropped

What it costs: attention over C rows, not max(lengths) + Q, and the pad rows' work. On a GPU a one-row
step is launch-bound (docs/decisions/018-accelerators.md) and both are nearly free; on a CPU the
dynamic store stays the default. Why and what was measured: docs/decisions/025-static-steps.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.introspect import text_config
from specdec.kv.blocks import BlockInputs, WritePlan, block_bias, causal
from specdec.kv.bmc import BMCCache, BMCConfig, BMCLayer
from specdec.quant.numerics import kv_dtype
from specdec.runtime.graphs import CAPTURES, StepGraphs


@dataclass(frozen=True)
class StaticShapes:
    # the block sizes a target forward runs at: Q rows run as the smallest >= Q; a block past the
    # largest runs at its own size, uncaptured (by then the step is compute-bound anyway)
    blocks: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # the store's rows come in multiples of this: fewer distinct capacities, fewer captures
    capacity_step: int = 256
    # "auto": CUDA graphs on a CUDA target, the same static steps run eagerly elsewhere; "eager";
    # "cuda"; "trace": captured by torch.fx on any device and replayed, baking every host value as a CUDA
    # graph would (a CPU rehearsal of capture's rules: the tests; float64/fp32 without the CPU kernels)
    capture: str = "auto"

    def __post_init__(self) -> None:
        if not self.blocks or any(b < 1 for b in self.blocks) or list(self.blocks) != sorted(set(self.blocks)):
            raise ValueError(f"StaticShapes.blocks must be increasing sizes >= 1, got {self.blocks}")
        if self.capacity_step < 1:
            raise ValueError(f"StaticShapes.capacity_step must be >= 1, got {self.capacity_step}")
        if self.capture not in CAPTURES:
            raise ValueError(f"StaticShapes.capture must be one of {', '.join(CAPTURES)}, got {self.capture!r}")

    def bucket(self, q: int) -> int:
        """The block size Q rows run at. Example, blocks (1, 2, 4, 8): 3 -> 4; 8 -> 8; 9 -> 9."""
        return next((b for b in self.blocks if b >= q), q)

    def capacity(self, rows: int) -> int:
        """Store rows for sequences of up to ``rows`` committed rows: room for the largest block after
        them, rounded up to ``capacity_step``. Example, step 256, largest block 64: 300 -> 512."""
        return math.ceil((rows + self.blocks[-1]) / self.capacity_step) * self.capacity_step


class StaticLayer(BMCLayer):
    """A BMC layer that writes at a row index tensor and hands back its whole buffers."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, H, Q, D]; plan.row_index [B, Q] (computed on the device)
        plan = self.store._plan
        assert plan is not None and plan.row_index is not None, "StaticCache: plan a block before its forward"
        B, H, Q, D = key_states.shape
        assert tuple(plan.row_index.shape) == (B, Q), f"block {B}x{Q} != planned {tuple(plan.row_index.shape)}"
        if self.keys is None:
            self.resize(self.store.capacity_rows, key_states, value_states, B)
        self.keys.scatter_(2, plan.row_index[:, None, :, None].expand(B, H, Q, D), key_states.to(self.keys.dtype))
        self.values.scatter_(2, plan.row_index[:, None, :, None].expand_as(value_states),
                             value_states.to(self.values.dtype))
        return self.keys, self.values  # every row: the bias hides the ones not this block's

    def adopt(self, rk: torch.Tensor, rv: torch.Tensor, rows: int) -> None:
        moved = self._room_kv is None or self._room_kv[0] is not rk
        super().adopt(rk, rv, rows)
        if moved:  # graphs captured on the old buffers would write where nothing lives now
            self.store.moved()


class StaticCache(BMCCache):
    """The BMC store with fixed buffers and device-side block inputs (see the module doc)."""

    layer_class = StaticLayer

    def __init__(self, num_layers: int, batch_size: int, rows: int, shapes: StaticShapes = StaticShapes(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype | None = None) -> None:
        self.shapes = shapes
        self.capacity_rows = shapes.capacity(rows)  # C, what buffers are made with
        self.graphs = StepGraphs(shapes.capture, torch.device(device))
        super().__init__(num_layers, batch_size, BMCConfig(period=shapes.capacity_step), dtype, device, kv_dtype)

    @classmethod
    def for_model(cls, model, batch_size: int, rows: int, shapes: StaticShapes = StaticShapes()) -> "StaticCache":
        """A store for ``model``'s layers, ``batch_size`` rows, sequences of up to ``rows`` rows, K/V in the dtype
        its numerics keeps them in (``quant.numerics.kv_dtype``)."""
        return cls(text_config(model).num_hidden_layers, batch_size, rows, shapes, model.dtype, model.device,
                   kv_dtype(model))

    def moved(self) -> None:
        """A layer's buffers moved: the graphs captured on the old ones go."""
        self.graphs.clear()

    def plan_block(self, q: int) -> None:
        """Plan a forward of ``q`` rows per batch row at each row's length (its rows' index is the
        step's to compute: ``forward.static_step``); buffers grown first if a row would pass C."""
        need = self.max_length + q
        if need > self.capacity_rows:
            self.reserve(need)
        self._plan = WritePlan(self.lengths, q, self.device, index=False)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in every batch row (new buffers, the committed rows copied)."""
        self.capacity_rows = max(self.capacity_rows, self.shapes.capacity(rows))
        with torch.inference_mode():
            for layer in self.layers:
                if layer.keys is not None and layer.capacity < self.capacity_rows:
                    layer.reshape(layer.room_rows, self.capacity_rows)

    def prepare(self, block_mask: torch.Tensor, depth: torch.Tensor) -> BlockInputs:
        """``BMCCache.prepare`` over all C rows (for a caller running its own forward on this store)."""
        B, Q, _ = block_mask.shape
        self.plan_block(Q)
        starts = torch.tensor(self.lengths, device=self.device)  # [B]
        self._plan.row_index = starts[:, None] + torch.arange(Q, device=self.device)
        bias = block_bias(starts, block_mask.to(self.device), self.capacity_rows, self.dtype)
        return BlockInputs(starts[:, None] + depth.to(self.device), bias)

    def prepare_chain(self, q: int) -> BlockInputs:
        return self.prepare(causal(q, self.device).expand(self.batch_size, q, q), torch.arange(q).expand(self.batch_size, q))

    def direct_buffers(self):
        return None  # the lean forward's one call writes at host offsets: it takes the layer loop here

    def load_prefill(self, b: int, layers: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> None:
        self.capacity_rows = max(self.capacity_rows, self.shapes.capacity(capacity))
        super().load_prefill(b, layers, self.capacity_rows)

    def _fit_buffers(self) -> None:
        """No shrink when rows leave (``BMCCache.select``): the buffers stay where the graphs expect them."""

    def append(self, other: "BMCCache") -> None:
        self.capacity_rows = max(self.capacity_rows, other.capacity)  # both multiples of the step
        super().append(other)

    def fits(self, batch: int, rows: int, shapes: StaticShapes) -> bool:
        """Whether a session of ``batch`` sequences of up to ``rows`` rows can run here, in at most twice
        the capacity it needs (attention reads every row)."""
        need = shapes.capacity(rows)
        room = self.layers[0].room_rows
        return shapes == self.shapes and need <= self.capacity_rows <= 2 * need and (room == 0 or room >= batch)

    def reset(self, batch: int) -> None:
        """Empty, for ``batch`` new sequences, in the same buffers (what they held is padding now)."""
        assert self._plan is None, "reset() between forwards only"
        self.lengths = [0] * batch
        for layer in self.layers:
            if layer._room_kv is not None:
                layer.adopt(*layer._room_kv, batch)


class SpareStore:
    """The last static store a decoder's session let go of, lent to its next session where it fits: its
    buffers, and the graphs captured on them, live on across ``generate`` calls (a capture costs a
    warm-up step and a recording per shape). At most one is kept: one store's memory."""

    def __init__(self) -> None:
        self._store: StaticCache | None = None

    def take(self, model, batch: int, rows: int, shapes: StaticShapes) -> StaticCache:
        store, self._store = self._store, None
        if store is not None and store.fits(batch, rows, shapes):
            store.reset(batch)
            return store
        return StaticCache.for_model(model, batch, rows, shapes)

    def give(self, store: BMCCache) -> None:
        if isinstance(store, StaticCache):
            self._store = store
