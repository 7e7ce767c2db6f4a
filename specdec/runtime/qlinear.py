"""Linear layers over GGUF blocks for a few rows on CPU: ``csrc/quant_linear.cpp``, where it wins.

A quantized target's ``QuantLinear`` (``specdec.quant.modules``) asks ``linear`` first and falls back
to its reference forward (dequantize, F.linear) when this returns None. The kernel dequantizes each
block in registers with the reference's own fp32 operations and accumulates in fp32, so its result is
the reference's up to summation order (docs/decisions/015-quant-kernels.md).

Which block sizes take it is a self-check per process, kernel variant and format (``routes``), as
``calibrate`` does for the fp32 routes: the kernel against the reference on random blocks for 1..MAX_ROWS
rows (and one chunked block of 2 * MAX_ROWS rows for MAX_ROWS + 1 .. CHUNK_ROWS), kept for a size only
where it agrees with the reference to fp32 rounding and is faster. Past CHUNK_ROWS (prefills) the
reference runs: one dequantization, then MKL's GEMM.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.config import RuntimeConfig, current
from specdec.quant.formats import BlockFormat, dequantize, random_blocks
from specdec.runtime import state
from specdec.runtime.state import CHUNK_ROWS, MAX_ROWS, Active

log = logging.getLogger(__name__)
KERNEL_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")  # what csrc/quant_linear.cpp decodes
CHECK_FEATURES = (576, 1536)  # [N, K] of the self-check's matrices (the default model's MLP; K: whole K blocks)


@dataclass(frozen=True)
class QuantRoutes:
    kernel: tuple[bool, ...]  # [MAX_ROWS] the kernel for 1..MAX_ROWS rows (index 0: 1 row); else the reference
    chunked: bool  # MAX_ROWS + 1 .. CHUNK_ROWS rows by the kernel (its balanced passes) too


# (kernel variant, format name) -> its routes, once checked in this process
CALIBRATED: dict[tuple[str | None, str], QuantRoutes] = {}


def uncalibrated(built: bool) -> QuantRoutes:
    """Without the self-check: the kernel for every size up to CHUNK_ROWS where it is built."""
    return QuantRoutes((built,) * MAX_ROWS, built)


def routes(fmt: BlockFormat, rt: Active | None = None) -> QuantRoutes:
    """The routes of ``fmt`` under ``rt`` (default: the record in force): checked on first use where the
    configuration calibrates, else the uncalibrated ones."""
    rt = state.active() if rt is None else rt
    key = (rt.config.variant, fmt.name)
    found = CALIBRATED.get(key)
    if found is not None:
        return found
    if rt.ops is None or fmt.name not in KERNEL_FORMATS:
        return uncalibrated(False)
    if not rt.config.calibrate:
        return uncalibrated(True)
    found = CALIBRATED[key] = self_check(rt, fmt)
    log.info("specdec kernels: %s blocks by the kernel for 1..%d rows: %s; chunks of more: %s", fmt.name,
             MAX_ROWS, found.kernel, found.chunked)
    return found


def prepare(formats, config: RuntimeConfig | None = None) -> None:
    """Check the routes of ``formats`` now (before any timed step), under ``config`` (default: in force)."""
    rt = state.resolve(current() if config is None else config)
    for fmt in formats:
        routes(fmt, rt)


def linear(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None
           ) -> torch.Tensor | None:
    """x [..., K] @ W^T (+ bias) -> [..., N] for W = ``blocks`` (uint8 [N, row_bytes] of ``fmt``) through
    the kernel, where its routes take this many rows of fp32 on CPU; None: the caller's reference."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > CHUNK_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or blocks.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    rt = state.active()
    if not takes(fmt, rows, rt):
        return None
    y = rt.ops.quant_linear(x.reshape(rows, x.shape[-1]), blocks, fmt.ggml_type)  # [rows, N]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], blocks.shape[0])


def takes(fmt: BlockFormat, rows: int, rt: Active | None = None) -> bool:
    """Whether ``linear`` runs the kernel for ``rows`` rows of fp32 on CPU in ``fmt`` (its routes)."""
    rt = state.active() if rt is None else rt
    if rt.ops is None or rows < 1 or rows > CHUNK_ROWS:
        return False
    r = routes(fmt, rt)
    return r.kernel[rows - 1] if rows <= MAX_ROWS else r.chunked


def agrees(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """The kernel's y equals the reference's to fp32 summation rounding (K products in another order)."""
    return bool(torch.isfinite(y).all()) and (y - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def self_check(rt: Active, fmt: BlockFormat, rounds: int = 2) -> QuantRoutes:
    """Per block size, the kernel where it agrees with the reference (on a small random matrix of ``fmt``)
    and beats it (on a [N, K] = CHECK_FEATURES one, fastest of ``rounds`` rounds, the two alternating).
    The kernel's time grows with the rows and the reference's is mostly its dequantization, so the
    sizes are timed from MAX_ROWS down until the kernel wins, and it takes every size below that."""
    g = torch.Generator().manual_seed(0)
    small, big = random_blocks(fmt, 24, 2 * fmt.block_weights, g), random_blocks(fmt, *CHECK_FEATURES, g)

    def kernel(x, w):
        return rt.ops.quant_linear(x, w, fmt.ggml_type)

    def reference(x, w):
        return F.linear(x, dequantize(w, fmt))

    def correct(rows: int) -> bool:
        x = torch.randn(rows, small.shape[1] // fmt.block_bytes * fmt.block_weights, generator=g, dtype=torch.float32)
        if agrees(kernel(x, small), reference(x, small)):
            return True
        log.warning("specdec: the %s block kernel disagrees with the reference at %d rows; not used there",
                    fmt.name, rows)
        return False

    def faster(rows: int) -> bool:
        x = torch.randn(rows, CHECK_FEATURES[1], generator=g, dtype=torch.float32)
        times = {kernel: float("inf"), reference: float("inf")}
        for _ in range(rounds):
            for fn in (reference, kernel):
                t = time.perf_counter()
                fn(x, big)
                times[fn] = min(times[fn], time.perf_counter() - t)
        return times[kernel] < times[reference]

    token = state.pin(rt)
    try:
        with torch.inference_mode():
            ok = [correct(m) for m in range(1, 2 * MAX_ROWS + 1)]
            wins = [False] * MAX_ROWS
            for m in range(MAX_ROWS, 0, -1):
                if faster(m):
                    wins[:m] = [True] * m
                    break
            return QuantRoutes(tuple(w and c for w, c in zip(wins, ok)), all(ok) and faster(2 * MAX_ROWS))
    finally:
        state.unpin(token)
