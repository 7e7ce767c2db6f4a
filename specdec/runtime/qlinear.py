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

A third route is for drafts only: inside ``approximate()`` (a self-speculative drafter's own forwards),
one or two rows over Q4_0 / Q4_1 / Q8_0 blocks may take ``quant_linear_i8`` (``csrc/int8_linear.cpp``: x
rounded to int8 per block, integer dot products), where its own self-check finds it close to the
reference and faster than the exact kernel (``approximates``). Never a target's verify: the context is
entered around a draft forward and left after it.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.config import RuntimeConfig, current
from specdec import formats
from specdec.formats import BlockFormat, dequantize, random_blocks
from specdec.runtime import state, verdicts
from specdec.runtime.state import CHUNK_ROWS, MAX_ROWS, Active

log = logging.getLogger(__name__)
KERNEL_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")  # what csrc/quant_linear.cpp decodes
CHECK_FEATURES = (576, 1536)  # [N, K] of the self-check's matrices (the default model's MLP; K: whole K blocks)
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
APPROX_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # what drafts' int8 route takes over an exact target's blocks
INT8_FORMATS = (*APPROX_FORMATS, "Q4_K")  # what csrc/int8_linear.cpp multiplies: a target in int8 numerics
APPROX_ROWS = 2  # more rows: the exact kernel, which decodes each block once for all of them
APPROX_ERROR = 0.05  # the int8 route's largest relative error (norm) against the reference in its self-check
APPROX_CHECK_MB = 48  # the int8 route's timing streams this many MB of blocks (past a CPU's caches)
# ... the fastest of this many rounds each (fewer let a shared machine's noise decide: 015, Measurements)
APPROX_CHECK_ROUNDS = 9
# (kernel variant, format name) -> whether drafts take the int8 route, once checked in this process
APPROXIMATES: dict[tuple[str | None, str], bool] = {}
_approximate: ContextVar[bool] = ContextVar("specdec_approximate", default=False)


@contextmanager
def approximate(on: bool = True):
    """Within: linear layers of 1..APPROX_ROWS rows over Q4_0 / Q4_1 / Q8_0 blocks may take the int8 route
    (``approximates``). For a drafter's own forwards only: their outputs are guesses the verifier checks."""
    token = _approximate.set(on)
    try:
        yield
    finally:
        _approximate.reset(token)


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
            approximates(fmt, rt)


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
    if numerics == "int8":  # ``blocks`` then ``interleave``d
        return _int8(x, blocks, fmts, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or x.dtype != torch.float32 or x.device.type != "cpu"
            or any(b.device.type != "cpu" for b in blocks) or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    rt = state.active()
    if rt.ops is None:
        return None
    x2 = x.reshape(rows, x.shape[-1])
    if by_int8(fmts, rows, rt):
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


INTERLEAVED = 0x100  # a format code's flag to quant_linear_i8: the part's blocks are ``interleave``d


Q4K_INTERLEAVED_BYTES = 148  # an interleaved Q4_K copy's bytes per feature and 256 weights (the file's: 144)


INTERLEAVE_FEATURES = 1024  # features rearranged at a time: the temporaries stay a few MB whatever the weight


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``blocks`` (uint8 [N, row_bytes] of INT8_FORMATS) in the int8 kernel's interleaved layout: features in
    groups of 16, each block of a group as the 16 scales (f16), Q4_1's 16 mins, then vectors of 64 bytes
    holding 4 codes of each feature (Q8_0's codes plus 128); Q4_K's 256-weight blocks as the 16 d, the 16
    dmin, the 8 sub-blocks' scales and mins as bytes (16 a sub-block), then the codes, 4 pairs of sub-blocks
    of 8 vectors each, [N, K / 256 * Q4K_INTERLEAVED_BYTES]; the features past the last whole group as they
    were (Q4_K's rows then padded with zeros to that size). ``csrc/int8_linear.cpp``'s comment says why."""
    if fmt.name not in INT8_FORMATS:
        raise ValueError(f"the int8 kernel multiplies {', '.join(INT8_FORMATS)} blocks, not {fmt.name}")
    N, row = blocks.shape
    nb = row // fmt.block_bytes
    out = torch.zeros(N, nb * Q4K_INTERLEAVED_BYTES if fmt.name == "Q4_K" else row, dtype=torch.uint8)
    whole = N // 16 * 16
    for a in range(0, whole, INTERLEAVE_FEATURES):
        part = blocks[a:min(whole, a + INTERLEAVE_FEATURES)]
        out[a:a + part.shape[0]] = _groups(part, fmt, nb)
    out[whole:, :row] = blocks[whole:]
    return out


def _groups(blocks: torch.Tensor, fmt: BlockFormat, nb: int) -> torch.Tensor:
    """``interleave`` of whole groups: blocks [16 G, row_bytes] -> the rows of their interleaved copy."""
    G, size = blocks.shape[0] // 16, fmt.block_bytes
    head = blocks.reshape(G, 16, nb, size).permute(0, 2, 1, 3)  # [G, nb, 16 features, block bytes]
    if fmt.name == "Q4_K":
        s = head[..., 4:16].to(torch.int16)  # [G, nb, 16, 12]: 6-bit scales and mins (formats._k_scales)
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        fields = [head[..., 0:2].reshape(G, nb, 32), head[..., 2:4].reshape(G, nb, 32),  # 16 d, 16 dmin
                  *(t.to(torch.uint8).transpose(-1, -2).reshape(G, nb, 128) for t in (sc, mn))]  # [sub][feature]
        codes = head[..., 16:].reshape(G, nb, 16, 4, 8, 4).permute(0, 1, 3, 4, 2, 5).reshape(G, nb, 2048)
        return torch.cat([*fields, codes], dim=-1).reshape(G * 16, nb * Q4K_INTERLEAVED_BYTES)
    scales = 4 if fmt.name == "Q4_1" else 2  # d (and m): f16 each
    fields = [head[..., f:f + 2].reshape(G, nb, 32) for f in range(0, scales, 2)]  # 16 d, then 16 m
    codes = head[..., scales:]
    if fmt.name == "Q8_0":
        codes = codes ^ 128
    chunks = codes.shape[-1] // 4  # 4-byte chunks a feature's codes (Q4: of nibble bytes)
    codes = codes.reshape(G, nb, 16, chunks, 4).permute(0, 1, 3, 2, 4).reshape(G, nb, chunks * 64)
    return torch.cat([*fields, codes], dim=-1).reshape(G * 16, nb * size)


def _int8(x: torch.Tensor, blocks: list[torch.Tensor], fmts: list[BlockFormat],
          bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_parts`` in int8 numerics: the int8 kernel for any number of rows (its rows are batch-invariant),
    over ``blocks`` already ``interleave``d (``QuantLinear.int8_blocks``)."""
    if x.device.type != "cpu" or any(b.device.type != "cpu" for b in blocks):
        raise RuntimeError("numerics='int8' runs on the CPU kernels only (this target is on "
                           f"{x.device.type}); load it with numerics='exact'")
    ops = state.active().ops
    if ops is None:
        raise RuntimeError("numerics='int8' needs specdec's CPU kernels, which are not built here (a C++ compiler "
                           "and ninja; see the README); load the target with numerics='exact'")
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    y = ops.quant_linear_i8(x2, blocks, [f.ggml_type | INTERLEAVED for f in fmts])
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


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


def by_int8(fmts: list[BlockFormat], rows: int, rt: Active | None = None) -> bool:
    """Whether ``rows`` rows through weights of ``fmts`` take the int8 route here: inside ``approximate()``,
    at most APPROX_ROWS rows, every format one the route ``approximates``."""
    return rows <= APPROX_ROWS and _approximate.get() and all(approximates(f, rt) for f in fmts)


def approximates(fmt: BlockFormat, rt: Active | None = None) -> bool:
    """Whether drafts take the int8 route for ``fmt`` (checked once per process, variant and format):
    its output within APPROX_ERROR of the reference's on random blocks at 1..APPROX_ROWS rows, and, where
    the configuration calibrates, faster than the exact kernel at one row over APPROX_CHECK_MB of a
    layer's linears streamed from memory, called as a draft's forward calls them (in cache the gain does
    not show; on a CPU with two 512-bit FMA units the exact kernel can be the faster:
    docs/decisions/015-quant-kernels.md, Decision: int8 draft route)."""
    rt = state.active() if rt is None else rt
    key = (rt.config.variant, fmt.name)
    found = APPROXIMATES.get(key)
    if found is None:
        found = APPROXIMATES[key] = (fmt.name in APPROX_FORMATS and rt.ops is not None
                                     and hasattr(rt.ops, "quant_linear_i8") and _approx_checked(rt, fmt))
        log.info("specdec kernels: drafts over %s blocks by int8 dot products: %s", fmt.name, found)
    return found


def _approx_checked(rt: Active, fmt: BlockFormat) -> bool:
    """``_approx_check``'s verdict, or where the configuration calibrates, the one an earlier process kept
    (``verdicts``): False as kept (the exact kernel: nothing to check), True only if ``_approx_close``
    passes again."""
    if not rt.config.calibrate:
        return _approx_check(rt, fmt)
    params = {"format": fmt.name, "features": list(CHECK_FEATURES), "mb": APPROX_CHECK_MB,
              "rounds": APPROX_CHECK_ROUNDS}
    kept = verdicts.load(rt.config, "int8-drafts", params)
    if kept is False or (kept is True and _approx_close(rt, fmt)):
        return kept
    found = _approx_check(rt, fmt)
    verdicts.store(rt.config, "int8-drafts", params, found)
    return found


def _approx_close(rt: Active, fmt: BlockFormat) -> bool:
    """The int8 route within APPROX_ERROR of the reference on small random blocks at 1..APPROX_ROWS rows
    (milliseconds: the untimed half of ``_approx_check``, and the spot check of a kept verdict)."""
    g = torch.Generator().manual_seed(1)
    small = random_blocks(fmt, 48, 4 * fmt.block_weights, g)
    with torch.inference_mode():
        for rows in range(1, APPROX_ROWS + 1):
            x = torch.randn(rows, small.shape[1] // fmt.block_bytes * fmt.block_weights, generator=g,
                            dtype=torch.float32)
            y, ref = rt.ops.quant_linear_i8(x, [small], [fmt.ggml_type]), F.linear(x, dequantize(small, fmt))
            if not bool(torch.isfinite(y).all()) or (y - ref).norm() > APPROX_ERROR * ref.norm():
                log.warning("specdec: the int8 draft kernel is off the %s reference at %d rows; drafts "
                            "take the exact kernel", fmt.name, rows)
                return False
    return True


def _approx_check(rt: Active, fmt: BlockFormat, rounds: int = APPROX_CHECK_ROUNDS) -> bool:
    """``_approx_close``, and where the configuration calibrates, the int8 route faster than the exact
    kernel over a layer's linears (``approximates``)."""
    if not _approx_close(rt, fmt):
        return False
    if not rt.config.calibrate:
        return True
    g = torch.Generator().manual_seed(2)
    token = state.pin(rt)
    try:
        with torch.inference_mode():
            # a step's weights come from memory, not a cache: time a pass over APPROX_CHECK_MB of blocks (the
            # codes' values do not change the time; the scales are finite: random_blocks' for one matrix), each
            # layer's linears in the calls a draft's forward makes (q, k, v and gate, up side by side)
            layer = [[random_blocks(fmt, n, k, g) for n, k in call] for call in _layer_calls()]
            copies = max(1, APPROX_CHECK_MB * 2**20 // sum(w.numel() for call in layer for w in call))
            weights = [[w.clone() for w in call] for _ in range(copies) for call in layer]  # distinct blocks
            xs = [torch.randn(1, call[0].shape[1] // fmt.block_bytes * fmt.block_weights, generator=g)
                  for call in layer] * copies
            types = [fmt.ggml_type] * 3
            best = {"i8": float("inf"), "exact": float("inf")}
            for _ in range(rounds):
                for name in ("exact", "i8"):
                    op = rt.ops.quant_linear_i8 if name == "i8" else rt.ops.quant_linear_parts
                    t = time.perf_counter()
                    for x, call in zip(xs, weights):
                        op(x, call, types[:len(call)])
                    best[name] = min(best[name], time.perf_counter() - t)
            log.info("specdec kernels: a layer's %s linears at one row: int8 %.0f us, exact %.0f us (fastest of %d)",
                     fmt.name, best["i8"] / copies * 1e6, best["exact"] / copies * 1e6, rounds)
            return best["i8"] < best["exact"]
    finally:
        state.unpin(token)


def _layer_calls() -> list[list[tuple[int, int]]]:
    """[N, K] of a Llama layer's linears at the CHECK_FEATURES width (the default model's: D = 576, 3 of 9
    heads' K/V, an MLP of 1536), grouped as the lean forward calls them: q, k, v; o; gate, up; down."""
    d, f = CHECK_FEATURES
    return [[(d, d), (d // 3, d), (d // 3, d)], [(d, d)], [(f, d), (f, d)], [(d, f)]]


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
