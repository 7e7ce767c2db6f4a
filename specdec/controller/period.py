"""The BMC store's period T on this machine: ``cost.optimal_period`` fed with costs timed here.

The model (``cost.optimal_period``): growing a cache from P to P + N rows T rows at a time costs
(N / T)(P + N / 2) c_copy in copies plus (T / 2) c_pad in padding rows, so T* = sqrt(2 N (P + N / 2)
c_copy / c_pad), a power of two, the padding capped at ``pad_share`` of the rows held. ``calibrate``
times c_copy and c_pad; the decoder asks again at every reallocation with the rows still expected,
so T grows with the sequence. Why this model and the cap: docs/decisions/001-bmc-store.md.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from specdec.controller.cost import PeriodCosts, optimal_period


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
    new buffer, and allocating + zero-filling ``rows`` new ones (medians of ``repeats``). Both scale
    with batch x layers alike: T* depends on their ratio only."""
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
