"""The self-check: which route each block size takes, and where the attention kernel beats SDPA.

Machines differ (a kernel shape that suits one CPU can be several times slower than torch on another),
so the routes are not trusted blindly: once per process and kernel variant, ``calibrate`` times every
linear route for each block size 1..MAX_ROWS, chunks against F.linear past it, and the attention kernel
against SDPA at each of ATTENTION_POINTS, and keeps the fastest; a route slower than torch's own for a
size is never taken for it. Why and what was measured: docs/decisions/002-linear-routes.md,
003-attention-kernel.md.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
import torch.nn.functional as F

from specdec.config import RuntimeConfig, current
from specdec.runtime import linear as lin
from specdec.runtime import state
from specdec.runtime.attention import ATTENTION_POINTS
from specdec.runtime.memory import Slabs
from specdec.runtime.state import CHUNK_ROWS, MAX_ROWS, ROUTES, Active, Routes

log = logging.getLogger(__name__)


def fastest_routes(seconds: dict[str, list[float]]) -> tuple[str, ...]:
    """Per block size, the route with the least time; torch's F.linear wins ties.

    seconds: route -> [MAX_ROWS] seconds for 1..MAX_ROWS rows (a missing route is not built).
    Example: {"linear": [3, 3], "mm": [2, 3], "packed": [1, 9]} -> ("packed", "linear").
    """
    order = [r for r in ROUTES if r in seconds]  # "linear" first: the tie goes to torch's own path
    n = len(seconds[order[0]])
    return tuple(min(order, key=lambda r: seconds[r][m]) for m in range(n))


def calibrate(config: RuntimeConfig | None = None, features: tuple[int, int] = (1536, 576), rounds: int = 3,
              vocab: int = 16384, stream_mb: int = 128) -> Routes:
    """The routes of ``config``'s kernel variant (default: the configuration in force), timed on this
    machine once per process (and kept: ``state.CALIBRATED``); the uncalibrated ones where
    ``config.calibrate`` is off and no earlier call timed them.

    The weights are random [N, K] matrices (N, K = ``features``, the default model's MLP) and one wide
    [``vocab``, K] one, the shape of a vocabulary projection, ``stream_mb`` MB in all, so they stream
    from memory as a model's weights do (a set that fits the last-level cache favours MKL's routes).
    They are cycled so no call finds its weight cached by the previous one; rounds alternate the
    routes, and each keeps its fastest round (noise only ever adds time).
    """
    config = current() if config is None else config
    done = state.CALIBRATED.get(config.variant)
    if done is not None or not config.calibrate:
        return done if done is not None else state.resolve(config).routes
    rt = state.resolve(config)
    token = state.pin(rt)  # the timed calls run on this configuration's ops
    try:
        routes = _calibrate(rt, features, rounds, vocab, stream_mb)
    finally:
        state.unpin(token)
    state.CALIBRATED[config.variant] = routes
    log.info("specdec kernels: routes per block size 1..%d: %s; %d-%d rows in chunks: %s; attention kernel "
             "per (rows, keys): %s", MAX_ROWS, routes.linear, MAX_ROWS + 1, CHUNK_ROWS, routes.chunked,
             None if routes.attention is None else dict(routes.attention))
    return routes


def _calibrate(rt: Active, features: tuple[int, int], rounds: int, vocab: int, stream_mb: int) -> Routes:
    g = torch.Generator().manual_seed(0)
    N, K = features
    count = max(1, -(-(stream_mb * 2**20 // 4 - vocab * K) // (N * K)))  # MLP matrices to fill stream_mb
    # the random weights, their packs and the attention's stores are cut from slabs of their own, mapped
    # for the check and unmapped after it (from the C heap they stayed as freed pages glibc keeps:
    # docs/decisions/015-quant-kernels.md, Decision: memory and build); the weights and the stores on
    # ordinary pages, as a
    # model's fp32 weights and its KV store are
    scratch = Slabs(hugepages=False)
    ws = [_uniform((N, K), g, scratch) for _ in range(count)]
    ws.append(_uniform((vocab, K), g, scratch))
    fns = {"linear": lambda x, w: F.linear(x, w), "mm": lin._skinny}
    if rt.ops is not None:
        # their packs, freed with them (pack() writes them outside inference mode)
        slabs = Slabs(hugepages=rt.config.hugepages)
        for w in ws:
            lin.pack(w, rt, slabs)
        fns["packed"] = lin._packed_linear
        if rt.ops.has_wide():
            fns["wide"] = partial(lin._packed_linear, wide=True)
    best: dict[str, list[float]] = {r: [] for r in fns}
    for m in range(1, MAX_ROWS + 1):
        for r, t in _fastest_rounds(fns, torch.randn(m, K, generator=g, dtype=torch.float32), ws, rounds).items():
            best[r].append(t)
    linear = fastest_routes(best)
    token = state.pin(Active(rt.config, rt.ops, Routes(linear, True), rt.max_rows))  # the chunks' routes
    try:
        chunked = _calibrate_chunks(ws, g, rounds)
    finally:
        state.unpin(token)
    del ws, scratch
    return Routes(linear, chunked, calibrate_attention(rt.ops, g, rounds, stream_mb))


def _uniform(shape: tuple[int, int], g: torch.Generator, slabs: Slabs) -> torch.Tensor:
    return slabs.take(shape[0] * shape[1]).view(shape).uniform_(-1, 1, generator=g)


def _calibrate_chunks(ws: list[torch.Tensor], g: torch.Generator, rounds: int) -> bool:
    """Whether chunks past MAX_ROWS beat F.linear: timed over twice MAX_ROWS rows, fastest round of each
    (the same guard as the routes')."""

    def in_chunks(x: torch.Tensor, w: torch.Tensor) -> bool | None:
        return None if any(lin._route(x[a:b], w) is None for a, b in lin.chunks(len(x))) else True

    x = torch.randn(2 * MAX_ROWS, ws[0].shape[1], generator=g, dtype=torch.float32)
    times = _fastest_rounds({"linear": lambda x, w: F.linear(x, w), "chunks": in_chunks}, x, ws, rounds)
    return times["chunks"] < times["linear"]


def _fastest_rounds(fns: dict, x: torch.Tensor, ws: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """Seconds of each ``fns[route](x, w)`` over all of ``ws``, its fastest of ``rounds`` rounds, the
    routes alternating within each round; inf for a route that returned None (not available)."""
    times: dict[str, list[float]] = {r: [] for r in fns}
    with torch.inference_mode():
        for _ in range(rounds):
            for r, fn in fns.items():
                t = time.perf_counter()
                if any(fn(x, w) is None for w in ws):
                    times[r].append(float("inf"))
                else:
                    times[r].append(time.perf_counter() - t)
    return {r: min(ts) for r, ts in times.items()}


def calibrate_attention(ops, g: torch.Generator, rounds: int, stream_mb: int):
    """Time the attention kernel against SDPA at every (rows, keys) point, on key/value stores shaped
    like the default model's (3 KV heads of 64), ``stream_mb`` MB of them so they come from memory as
    a model's do between its layers (slabs of their own, as ``_calibrate``'s weights); each point keeps
    the faster (SDPA on a tie). {} without a kernel."""
    if ops is None:
        return state.frozen_points({})
    slabs = Slabs(hugepages=False)
    f32 = dict(generator=g, dtype=torch.float32)
    points = {}
    for keys in ATTENTION_POINTS[1]:
        per_layer = 2 * 3 * keys * 64 * 4
        layers = max(2, min(64, stream_mb * 2**20 // per_layer))
        kv = [slabs.take(per_layer // 4).view(2, 1, 3, keys, 64).normal_(generator=g).unbind() for _ in range(layers)]
        for rows in ATTENTION_POINTS[0]:
            q = torch.randn(1, 3, rows, 64, **f32)
            bias = torch.zeros(1, 1, rows, keys, dtype=torch.float32)  # a block's mask, as the decoder hands SDPA one
            fns = {"sdpa": lambda _, kv_: F.scaled_dot_product_attention(q, *kv_, attn_mask=bias),
                   "kernel": lambda _, kv_: ops.attention(q, *kv_, bias, 0.125)}
            times = _fastest_rounds(fns, q, kv, rounds)
            points[rows, keys] = times["kernel"] < times["sdpa"]
    return state.frozen_points(points)
