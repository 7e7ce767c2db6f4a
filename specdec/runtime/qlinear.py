"""Linear layers over GGUF blocks on CPU: ``csrc/quant_linear.cpp``, where it wins.

A quantized target's ``QuantLinear`` (``specdec.quant.modules``) asks ``linear`` first and falls back
to its reference forward (dequantize, F.linear) when this returns None. Two routes, per format and
block size:

- the block kernel (``quant_linear``) for few rows (decode, verify, small batches): it dequantizes each
  block in registers with the reference's own fp32 operations and accumulates in fp32, so its result
  is the reference's up to summation order; more rows than MAX_ROWS run as its balanced passes;
- the GEMM for many rows (a prefill): the blocks dequantized by the kernel build's decoder
  (``quant_dequantize``: the reference's values bit for bit, one op instead of torch's dozen),
  then torch's F.linear, the reference's own call on the same weights.

Which sizes take the kernel is a self-check per process, kernel variant and format (``routes``), as
``calibrate`` does for the fp32 routes: the kernel against the reference on random blocks for
1..2 * MAX_ROWS rows, kept for a size only where it agrees to fp32 rounding and is faster than the
GEMM on a [N, K] = CHECK_FEATURES matrix; past MAX_ROWS its passes run up to the largest of CHUNK_SIZES
at which they still win (docs/decisions/015-quant-kernels.md, Decision: routes and the prefill).

The int8 kernel (``csrc/int8_linear.cpp``) is ``runtime.int8_linear``'s: ``linear_parts`` hands it every
row of a target in int8 numerics, and a draft's one or two rows inside ``int8_linear.approximate()`` where
its own self-check chose it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.config import RuntimeConfig, current
from specdec import formats
from specdec.formats import BlockFormat, dequantize, random_blocks
from specdec.runtime import int8_linear, state, verdicts
from specdec.runtime.int8_linear import CHECK_FEATURES  # one matrix size for both kernels' self-checks
from specdec.runtime.state import CHUNK_ROWS, MAX_ROWS, Active

log = logging.getLogger(__name__)
KERNEL_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")  # what csrc/quant_linear.cpp decodes
CHUNK_SIZES = (24, 32, 48, 64, 96, CHUNK_ROWS)  # past MAX_ROWS, the block sizes the self-check times
# uncalibrated, the kernel's passes take blocks of up to this many rows and the GEMM larger ones (one
# machine's figure: docs/decisions/015-quant-kernels.md, Decision: routes and the prefill)
UNCALIBRATED_CHUNKS = 32
# the block sizes a kept verdict's spot check runs: each end of the kernel's row blocks (8 rows on AVX2, 16 on
# AVX-512) and of its passes past MAX_ROWS; the full check (``self_check``) runs every size 1..2 * MAX_ROWS
SPOT_ROWS = (1, 2, 7, 8, 9, 15, 16, 17, 24, 32)


@dataclass(frozen=True)
class QuantRoutes:
    kernel: tuple[bool, ...]  # [MAX_ROWS] the kernel for 1..MAX_ROWS rows (index 0: 1 row); else the GEMM
    chunked_to: int  # MAX_ROWS + 1 .. chunked_to rows by the kernel's passes too (MAX_ROWS: none); more: the GEMM
    gemm: bool  # the build's dequantization equals the reference's (else the reference runs instead)


# (kernel variant, format name) -> its routes, once checked in this process
CALIBRATED: dict[tuple[str | None, str], QuantRoutes] = {}


def uncalibrated(built: bool) -> QuantRoutes:
    """Without the self-check: the kernel for every size up to UNCALIBRATED_CHUNKS where it is built."""
    return QuantRoutes((built,) * MAX_ROWS, UNCALIBRATED_CHUNKS if built else MAX_ROWS, built)


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
    found = CALIBRATED[key] = _checked(rt, fmt)
    log.info("specdec kernels: %s blocks by the kernel for 1..%d rows: %s; its passes up to %d rows; the "
             "GEMM: %s", fmt.name, MAX_ROWS, found.kernel, found.chunked_to, found.gemm)
    return found


def _checked(rt: Active, fmt: BlockFormat) -> QuantRoutes:
    """The verdict an earlier process kept for this machine and build (``verdicts``) where it reads back
    whole and its spot check passes (``correctness`` anew at SPOT_ROWS: each of them it routes to the kernel
    agrees, and the GEMM only where the dequantization is still exact); else ``self_check``'s, kept for the next."""
    params = {"format": fmt.name, "features": list(CHECK_FEATURES), "chunks": list(CHUNK_SIZES)}
    record = verdicts.load(rt.config, "quant-routes", params)
    try:
        kept = None if record is None else QuantRoutes(tuple(bool(k) for k in record["kernel"]),
                                                       int(record["chunked_to"]), bool(record["gemm"]))
    except (KeyError, TypeError, ValueError):
        kept = None
    if kept is not None and len(kept.kernel) == MAX_ROWS and kept.chunked_to in (MAX_ROWS, *CHUNK_SIZES):
        ok, exact = correctness(rt, fmt, SPOT_ROWS)  # each size a call: under load a call can cost a time slice
        if kept.gemm == exact and all(o for m, o in ok.items() if m <= MAX_ROWS and kept.kernel[m - 1]) and (
                kept.chunked_to == MAX_ROWS or all(ok.values())):
            return kept
        log.warning("specdec: the kept %s self-check disagrees with a spot check of its kernel; checking again",
                    fmt.name)
    found = self_check(rt, fmt)
    verdicts.store(rt.config, "quant-routes", params,
                   {"kernel": list(found.kernel), "chunked_to": found.chunked_to, "gemm": found.gemm})
    return found


def prepare(formats, config: RuntimeConfig | None = None, drafts: bool = False) -> None:
    """Check the routes of ``formats`` now (before any timed step), under ``config`` (default: in force);
    with ``drafts``, the int8 route of drafts over them too (else checked on a draft's first use, if any)."""
    rt = state.resolve(current() if config is None else config)
    for fmt in formats:
        routes(fmt, rt)
        if drafts:
            int8_linear.approximates(fmt, rt)


def linear(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None = None,
           numerics: str = "exact") -> torch.Tensor | None:
    """x [..., K] @ W^T (+ bias) -> [..., N] for W = ``blocks`` (uint8 [N, row_bytes] of ``fmt``) by the
    routes (fp32 on CPU, the kernels built); None: the caller's reference. numerics: ``linear_parts``."""
    return linear_parts(x, [blocks], [fmt], bias, numerics)


def linear_parts(x: torch.Tensor, blocks: list[torch.Tensor], fmts: list[BlockFormat],
                 bias: torch.Tensor | None = None, numerics: str = "exact") -> torch.Tensor | None:
    """x [..., K] through several weights side by side (q, k, v; gate, up) -> [..., sum of N] (+ bias
    [sum of N]): the kernel's one call over them where its routes take this many rows for every format,
    else the GEMM; None where neither runs (another dtype or device, grad, no kernels built, a format
    whose dequantization disagreed): the caller's reference. With numerics "int8" (``quant.numerics``)
    every row count takes the int8 kernel, whose arithmetic defines that target: no other route, and
    an error where it cannot run."""
    if numerics == "int8":  # ``blocks`` then ``int8_linear.interleave``d
        return int8_linear.linear(x, blocks, fmts, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or x.dtype != torch.float32 or x.device.type != "cpu"
            or any(b.device.type != "cpu" for b in blocks) or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    rt = state.active()
    if rt.ops is None:
        return None
    x2 = x.reshape(rows, x.shape[-1])
    if int8_linear.by_int8(fmts, rows, rt):
        y = rt.ops.quant_linear_i8(x2, blocks, [f.ggml_type for f in fmts])  # a draft's: approximate
        if bias is not None:
            y = y + bias
    elif all(takes(f, rows, rt) for f in fmts):
        y = rt.ops.quant_linear_parts(x2, blocks, [f.ggml_type for f in fmts])  # [rows, N]
        if bias is not None:
            y = y + bias
    elif all(routes(f, rt).gemm for f in fmts):
        y = gemm(x2, blocks, fmts, rt.ops, bias)
    else:
        return None
    return y.view(*x.shape[:-1], y.shape[-1])


def dequantized(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor | None:
    """float32 [N, K] of ``blocks`` (uint8 [N, row_bytes] of ``fmt``, on CPU) by the kernel build's
    decoder where its self-check found it equal to the reference's (an embedding's looked-up rows: one
    call instead of torch's dozen small ops); None: the caller's reference."""
    if blocks.device.type != "cpu" or blocks.shape[0] == 0:
        return None
    rt = state.active()
    if rt.ops is None or not routes(fmt, rt).gemm:
        return None
    return _decoded(rt.ops, blocks, fmt)


def _decoded(ops, blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """float32 [N, K] of ``blocks`` by the build's ``quant_dequantize`` (unchecked: the self-check's subject)."""
    out = torch.empty(blocks.shape[0], blocks.shape[1] // fmt.block_bytes * fmt.block_weights, dtype=torch.float32)
    ops.quant_dequantize([blocks], [fmt.ggml_type], out)
    return out


def gemm(x: torch.Tensor, blocks: list[torch.Tensor], fmts: list[BlockFormat], ops,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, sum of N] (+ bias): the weights dequantized by ``ops`` (each in slices of at most
    CHUNK_FLOATS weights, as the reference slices them; whole weights that fit together share one slice),
    F.linear per slice. A weight alone is its reference's computation exactly: the same values, the same
    calls (``QuantLinear.reference``)."""
    K = x.shape[-1]
    step = max(1, formats.CHUNK_FLOATS // K)  # output features a slice
    slices: list[list[tuple[torch.Tensor, BlockFormat]]] = []  # consecutive weights (or slices of one)
    for b, f in zip(blocks, fmts):
        for i in range(0, b.shape[0], step):
            part = b[i:i + step]
            if slices and sum(p.shape[0] for p, _ in slices[-1]) + part.shape[0] <= step:
                slices[-1].append((part, f))
            else:
                slices.append([(part, f)])
    outs = []
    # one buffer for every slice's dequantization, each overwriting the last: a new one per slice fragmented
    # the C heap, which glibc then kept (decision 015, Decision: memory and build)
    features = [sum(p.shape[0] for p, _ in parts) for parts in slices]
    buffer = torch.empty(max(features) * K, dtype=torch.float32, device=x.device)
    for parts, n in zip(slices, features):  # each slice dequantized, its output features computed
        w = buffer[:n * K].view(n, K)
        ops.quant_dequantize([p for p, _ in parts], [f.ggml_type for _, f in parts], w)
        outs.append(F.linear(x, w, bias if len(slices) == 1 else None))
    if len(outs) == 1:
        return outs[0]
    y = torch.cat(outs, dim=-1)
    return y if bias is None else y + bias


def takes(fmt: BlockFormat, rows: int, rt: Active | None = None) -> bool:
    """Whether ``linear`` runs the kernel for ``rows`` rows of fp32 on CPU in ``fmt`` (its routes)."""
    rt = state.active() if rt is None else rt
    if rt.ops is None or rows < 1 or rows > CHUNK_ROWS:
        return False
    r = routes(fmt, rt)
    return r.kernel[rows - 1] if rows <= MAX_ROWS else rows <= r.chunked_to


def agrees(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """The kernel's y equals the reference's to fp32 summation rounding (K products in another order)."""
    return bool(torch.isfinite(y).all()) and (y - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def correctness(rt: Active, fmt: BlockFormat, sizes=None) -> tuple[dict[int, bool], bool]:
    """The untimed half of ``self_check`` (milliseconds): per block size in ``sizes`` (default 1..2 *
    MAX_ROWS; a kept verdict's spot check takes SPOT_ROWS), whether the kernel agrees with the reference on
    a small random matrix of ``fmt``, and whether the build's dequantization equals the reference's bit for bit."""
    g = torch.Generator().manual_seed(0)
    small = random_blocks(fmt, 24, 2 * fmt.block_weights, g)
    sizes = range(1, 2 * MAX_ROWS + 1) if sizes is None else sizes

    def correct(rows: int) -> bool:
        x = torch.randn(rows, small.shape[1] // fmt.block_bytes * fmt.block_weights, generator=g, dtype=torch.float32)
        if agrees(rt.ops.quant_linear(x, small, fmt.ggml_type), F.linear(x, dequantize(small, fmt))):
            return True
        log.warning("specdec: the %s block kernel disagrees with the reference at %d rows; not used there",
                    fmt.name, rows)
        return False

    with torch.inference_mode():
        ok = {m: correct(m) for m in sizes}
        if torch.equal(_decoded(rt.ops, small, fmt).view(torch.int32), dequantize(small, fmt).view(torch.int32)):
            return ok, True
    log.warning("specdec: the %s dequantization of the kernel build disagrees with the reference; "
                "many rows take the reference", fmt.name)
    return ok, False


def self_check(rt: Active, fmt: BlockFormat, rounds: int = 2) -> QuantRoutes:
    """The GEMM where the build's dequantization equals the reference's bit for bit (a small random
    matrix of ``fmt``); per block size, the kernel where it agrees with the reference there and beats
    what would run instead (the GEMM, else the reference) on a [N, K] = CHECK_FEATURES matrix, fastest of
    ``rounds`` rounds, the two alternating (``correctness``, then the timing). The kernel's time grows with
    the rows, the GEMM's far more slowly: sizes 1..MAX_ROWS are timed from MAX_ROWS down until the kernel
    wins (it takes every size below), its passes beyond from CHUNK_SIZES up until it loses."""
    ok, fast = correctness(rt, fmt)
    g = torch.Generator().manual_seed(1)
    big = random_blocks(fmt, *CHECK_FEATURES, g)

    def kernel(x, w):
        return rt.ops.quant_linear(x, w, fmt.ggml_type)

    def reference(x, w):
        return F.linear(x, dequantize(w, fmt))

    def faster(rows: int, other) -> bool:
        x = torch.randn(rows, CHECK_FEATURES[1], generator=g, dtype=torch.float32)
        times = {kernel: float("inf"), other: float("inf")}
        for _ in range(rounds):
            for fn in (other, kernel):
                t = time.perf_counter()
                fn(x, big)
                times[fn] = min(times[fn], time.perf_counter() - t)
        return times[kernel] < times[other]

    token = state.pin(rt)
    try:
        with torch.inference_mode():
            other = (lambda x, w: gemm(x, [w], [fmt], rt.ops)) if fast else reference
            wins = [False] * MAX_ROWS
            for m in range(MAX_ROWS, 0, -1):
                if faster(m, other):
                    wins[:m] = [True] * m
                    break
            chunked_to = MAX_ROWS
            if all(ok.values()):
                for m in CHUNK_SIZES:
                    if not faster(m, other):
                        break
                    chunked_to = m
            return QuantRoutes(tuple(wins[m - 1] and ok[m] for m in range(1, MAX_ROWS + 1)), chunked_to, fast)
    finally:
        state.unpin(token)
