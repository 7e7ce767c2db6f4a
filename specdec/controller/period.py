"""The BMC period T: how many rows the store adds per reallocation, from costs measured on the machine.

BMC's trade (Ruan et al.): growing a cache of final length N by T rows at a time copies it N / T
times, ~ N^2 / (2T) row copies in all, while every allocated-but-unused row costs ``c_pad``; BMC's
store attends its padding every step (N x T / 2 padded row-steps), which gives T* = sqrt(N c_copy /
c_pad). specdec's store attends a *view* of the rows in use, so a padded row costs no attention;
what it costs is its allocation (zero-filled, faulted in) and its memory, once, not per step. The
time for a generation that grows a cache from P to P + N rows is then

    time(T) = (N / T) x (P + N / 2) x c_copy      copies: one per T rows, each of the rows held then
            + (T / 2) x c_pad                      rows allocated past the end, on average T / 2

    T* = sqrt(2 N (P + N / 2) c_copy / c_pad)

rounded to a power of two (the kernels' and the allocator's sizes) and capped so the padding never
holds more than ``pad_share`` of the rows in use (memory: at batch 8 and 8k tokens a row of every
layer is 8 x 46 KB). Worked example: P = 2048, N = 512, c_copy = 2 us, c_pad = 1 us ->
sqrt(2 x 512 x 2304 x 2) = 2172 -> 2048, capped at 2048 / 8 = 256 -> T = 256.

The final length is unknown up front, so the decoder asks again at every reallocation with the
rows still expected (``max_new_tokens`` left): T grows as the sequence grows, as BMC's optimal number
of allocations grows with the square root of the final length.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeriodCosts:
    copy: float  # seconds to copy one cache row (K and V, all layers, every batch row) in a reallocation
    pad: float  # seconds to allocate one padding row (zero-fill, first touch)


def optimal_period(new_rows: int, held_rows: int, costs: PeriodCosts, pad_share: float = 0.125,
                   minimum: int = 64, maximum: int = 4096) -> int:
    """T* for a cache holding ``held_rows`` that will grow by ``new_rows`` more (see the module doc):
    the power of two nearest sqrt(2 N (P + N / 2) c_copy / c_pad), within [minimum, maximum] and at
    most ``pad_share`` x the rows held (rounded down to a power of two, never below ``minimum``).
    Example: new 512, held 2048, copy 2e-6, pad 1e-6 -> 2172 -> 2048, capped to 256."""
    if new_rows < 0 or held_rows < 0:
        raise ValueError(f"rows must be >= 0, got new {new_rows}, held {held_rows}")
    if costs.copy <= 0 or costs.pad <= 0:
        raise ValueError(f"costs must be > 0, got {costs}")
    t = math.sqrt(2.0 * max(new_rows, 1) * (held_rows + new_rows / 2.0) * costs.copy / costs.pad)
    t = 2 ** round(math.log2(max(t, 1.0)))
    cap = 2 ** math.floor(math.log2(max(pad_share * held_rows, 1.0)))
    return int(max(minimum, min(t, cap, maximum)))


@dataclass
class PeriodModel:
    costs: PeriodCosts
    pad_share: float = 0.125

    def period(self, final_length: int, length: int) -> int:
        """T for a cache of ``length`` rows expected to reach ``final_length``."""
        return optimal_period(max(0, final_length - length), length, self.costs, self.pad_share)


def calibrate(batch: int, kv_heads: int, head_dim: int, layers: int, rows: int = 8192,
              dtype: torch.dtype = torch.float32, repeats: int = 5) -> PeriodCosts:
    """Time what a reallocation does on this machine, per row: copying ``rows`` rows of K and V into a
    new buffer, and allocating + zero-filling ``rows`` new ones (medians of ``repeats``; ~20 ms at
    one layer and batch 1). Both scale with batch x layers alike: T* depends on their ratio only."""
    shape = (batch, kv_heads, rows, head_dim)
    src = torch.randn(*shape, dtype=dtype)
    copies, pads = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(2 * layers):  # K and V of every layer
            dst = torch.empty(batch, kv_heads, 2 * rows, head_dim, dtype=dtype)
            dst[:, :, :rows] = src
        t1 = time.perf_counter()
        for _ in range(2 * layers):
            torch.zeros(*shape, dtype=dtype)
        t2 = time.perf_counter()
        copies.append((t1 - t0) / rows)
        pads.append((t2 - t1) / rows)
    copies.sort()
    pads.sort()
    return PeriodCosts(copy=copies[len(copies) // 2], pad=pads[len(pads) // 2])


@functools.lru_cache(maxsize=None)
def machine_model(kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> PeriodModel:
    """The period model for this machine and an attention shape, calibrated once per process."""
    return PeriodModel(calibrate(1, kv_heads, head_dim, layers=1, dtype=dtype))
