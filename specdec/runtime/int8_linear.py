"""The int8 kernel (``csrc/int8_linear.cpp``, ``quant_linear_i8``) from Python: its layout and its two uses.

The kernel rounds x to int8 per block of 32 and multiplies the codes of Q4_0 / Q4_1 / Q8_0 / Q4_K blocks
as integers (llama.cpp's arithmetic; docs/decisions/019-int8-numerics.md). ``runtime.qlinear``, where a
``QuantLinear`` asks first, hands it the rows in two cases:

- int8 numerics (``quant.numerics``): a target loaded so runs every row count through it (``linear``), over
  a copy of its blocks in the kernel's interleaved layout (``interleave``, made once per layer by
  ``QuantLinear.int8_blocks``): its arithmetic defines that target, so no other route and no self-check;
- drafts (``by_int8``): inside ``approximate()`` (a self-speculative drafter's own forwards), one or two
  rows over Q4_0 / Q4_1 / Q8_0 blocks may take it where its own self-check finds it close to the reference
  and faster than the exact kernel (``approximates``). Never a target's verify: the context is entered
  around a draft forward and left after it (docs/decisions/015-quant-kernels.md, Decision: int8 draft route).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from specdec.formats import BlockFormat, dequantize, k_scale_bytes, q5_k_codes, q6_k_codes, random_blocks
from specdec.runtime import state, verdicts
from specdec.runtime.state import Active

log = logging.getLogger(__name__)
# [N, K] of the self-checks' matrices, this module's and ``qlinear``'s (the default model's MLP; K: whole K blocks)
CHECK_FEATURES = (576, 1536)
APPROX_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # what drafts' int8 route takes over an exact target's blocks
# what csrc/int8_linear.cpp multiplies: a target in int8 numerics
INT8_FORMATS = (*APPROX_FORMATS, "Q4_K", "Q5_K", "Q6_K")
APPROX_ROWS = 2  # more rows: the exact kernel, which decodes each block once for all of them
APPROX_ERROR = 0.05  # the int8 route's largest relative error (norm) against the reference in its self-check
APPROX_CHECK_MB = 48  # the int8 route's timing streams this many MB of blocks (past a CPU's caches)
# ... the fastest of this many rounds each (fewer let a shared machine's noise decide: 015, Measurements)
APPROX_CHECK_ROUNDS = 9
# (kernel variant, format name) -> whether drafts take the int8 route, once checked in this process
APPROXIMATES: dict[tuple[str | None, str], bool] = {}
_approximate: ContextVar[bool] = ContextVar("specdec_approximate", default=False)
INTERLEAVED = 0x100  # a format code's flag to quant_linear_i8: the part's blocks are ``interleave``d
GROUP = 16  # features a group of the interleaved copy: computed together, each its own dot product
# an interleaved K-format copy's bytes per feature and 256 weights (the file's: 144, 176, 210)
K_INTERLEAVED_BYTES = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}
INTERLEAVE_FEATURES = 1024  # features rearranged at a time: the temporaries stay a few MB whatever the weight


def interleave(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``blocks`` (uint8 [N, row_bytes] of INT8_FORMATS) in the int8 kernel's interleaved layout: features in
    groups of 16, each block of a group as the 16 scales (f16), Q4_1's 16 mins, then vectors of 64 bytes
    holding 4 codes of each feature (Q8_0's codes plus 128); Q4_K's 256-weight blocks as the 16 d, the 16
    dmin, the 8 sub-blocks' scales and mins as bytes (16 a sub-block), then the codes, 4 pairs of sub-blocks
    of 8 vectors each; Q5_K's as Q4_K's (its codes' low nibbles), then 8 vectors of their fifth bits (sub-block
    s at bit s); Q6_K's
    as the 16 d, the 16 sub-blocks' signed scales (16 bytes each), then the codes (0..63) in two planes of
    such vectors: low nibbles (a pair of sub-blocks of 16 a vector set, the first low), then top 2 bits (4
    sub-blocks a set, sub-block u at bits 2u); [N, K / 256 * K_INTERLEAVED_BYTES]. The features past the last whole group as they
    were (a K format's rows then padded with zeros to that size). ``csrc/int8_linear.cpp``'s comment says why."""
    if fmt.name not in INT8_FORMATS:
        raise ValueError(f"the int8 kernel multiplies {', '.join(INT8_FORMATS)} blocks, not {fmt.name}")
    N, row = blocks.shape
    nb = row // fmt.block_bytes
    out = torch.zeros(N, nb * K_INTERLEAVED_BYTES.get(fmt.name, fmt.block_bytes), dtype=torch.uint8)
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
        codes = head[..., 16:].reshape(G, nb, 16, 4, 8, 4).permute(0, 1, 3, 4, 2, 5).reshape(G, nb, 2048)
        return torch.cat([*_k_head(head), codes], dim=-1).reshape(G * 16, nb * K_INTERLEAVED_BYTES["Q4_K"])
    if fmt.name in ("Q5_K", "Q6_K"):
        return _k_groups(head, fmt.name)
    scales = 4 if fmt.name == "Q4_1" else 2  # d (and m): f16 each
    fields = [head[..., f:f + 2].reshape(G, nb, 32) for f in range(0, scales, 2)]  # 16 d, then 16 m
    codes = head[..., scales:]
    if fmt.name == "Q8_0":
        codes = codes ^ 128
    chunks = codes.shape[-1] // 4  # 4-byte chunks a feature's codes (Q4: of nibble bytes)
    codes = codes.reshape(G, nb, 16, chunks, 4).permute(0, 1, 3, 2, 4).reshape(G, nb, chunks * 64)
    return torch.cat([*fields, codes], dim=-1).reshape(G * 16, nb * size)


def _k_head(head: torch.Tensor) -> list[torch.Tensor]:
    """Q4_K's / Q5_K's group head from blocks [G, nb, 16 features, block bytes]: the 16 d, the 16 dmin (f16
    bytes), then the 8 sub-blocks' 6-bit scales and mins as bytes, 16 a sub-block ([sub][feature])."""
    G, nb = head.shape[:2]
    sc, mn = k_scale_bytes(head[..., 4:16])  # [G, nb, 16, 8] each
    return [head[..., 0:2].reshape(G, nb, 32), head[..., 2:4].reshape(G, nb, 32),
            *(t.to(torch.uint8).transpose(-1, -2).reshape(G, nb, 128) for t in (sc, mn))]


def _k_groups(head: torch.Tensor, name: str) -> torch.Tensor:
    """``_groups`` of Q5_K / Q6_K: head [G, nb, 16 features, block bytes] -> [16 G, nb * K_INTERLEAVED_BYTES]:
    the head fields, then each block's codes (``formats.q5_k_codes`` / ``q6_k_codes``) as vectors of 4 codes of
    each of the 16 features, split in two planes: low nibbles (sub-blocks 2i, 2i + 1 in one vector set, Q4_K's
    layout), then the top bits (Q5_K's fifth bit of sub-block s at bit s; Q6_K's top 2 bits of sub-block
    4i + u at bits 2u)."""
    G, nb = head.shape[:2]
    flat = head.reshape(-1, head.shape[-1])  # [G nb 16, bytes]: one block per row
    if name == "Q5_K":
        codes, fields = q5_k_codes(flat), _k_head(head)  # [n, 8 sub-blocks, 32]
    else:
        codes = q6_k_codes(flat)  # [n, 16 sub-blocks, 16]
        fields = [head[..., 208:210].reshape(G, nb, 32), head[..., 192:208].transpose(-1, -2).reshape(G, nb, 256)]
    subs, size = codes.shape[1:]
    # [G, nb, 16 features, subs, size / 4 vectors, 4] -> [G, nb, subs, vectors, 16 features, 4]
    codes = codes.reshape(G, nb, 16, subs, size // 4, 4).permute(0, 1, 3, 4, 2, 5)
    low, top = codes & 15, codes >> 4
    nibbles = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(G, nb, -1)
    if name == "Q5_K":
        top = sum(top[:, :, s] << s for s in range(8))
    else:
        top = top[:, :, 0::4] | (top[:, :, 1::4] << 2) | (top[:, :, 2::4] << 4) | (top[:, :, 3::4] << 6)
    return torch.cat([*fields, nibbles, top.reshape(G, nb, -1)], dim=-1).reshape(G * 16, nb * K_INTERLEAVED_BYTES[name])


def linear(x: torch.Tensor, blocks: list[torch.Tensor], fmts: list[BlockFormat],
           bias: torch.Tensor | None) -> torch.Tensor:
    """``qlinear.linear_parts`` in int8 numerics: the int8 kernel for any number of rows (its rows are
    batch-invariant), over ``blocks`` already ``interleave``d (``QuantLinear.int8_blocks``)."""
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


@contextmanager
def approximate(on: bool = True):
    """Within: linear layers of 1..APPROX_ROWS rows over Q4_0 / Q4_1 / Q8_0 blocks may take the int8 route
    (``approximates``). For a drafter's own forwards only: their outputs are guesses the verifier checks."""
    token = _approximate.set(on)
    try:
        yield
    finally:
        _approximate.reset(token)


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
