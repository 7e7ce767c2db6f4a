"""The self-check: which route each block size takes, and where the attention kernel beats SDPA.

Machines differ (a kernel shape that suits one CPU can be several times slower than torch on another),
so the routes are not trusted blindly: once per process and kernel variant, ``calibrate`` times every
linear route for each block size 1..MAX_ROWS, chunks against F.linear past it, and the attention kernel
against SDPA at each of ATTENTION_POINTS, and keeps the fastest; a route slower than torch's own for a
size is never taken for it. Why and what was measured: docs/decisions/002-linear-routes.md,
003-attention-kernel.md.

The verdict is kept on disk for later processes on the same machine and build (``verdicts``); one read
back is used only after ``spot_check`` found every kernel route it names right on small products.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
import torch.nn.functional as F

from specdec.config import RuntimeConfig, current
from specdec.runtime import linear as lin
from specdec.runtime import state, verdicts
from specdec.runtime.attention import ATTENTION_POINTS
from specdec.runtime.memory import Slabs
from specdec.runtime.state import CHUNK_ROWS, KERNEL_ROUTES, MAX_ROWS, ROUTES, Active, Routes

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
    routes, and each keeps its fastest round (noise only ever adds time). A verdict an earlier process
    kept for this machine, build and these parameters (``verdicts``) is taken instead where its
    ``spot_check`` passes (``config.calibration_cache``).
    """
    config = current() if config is None else config
    done = state.CALIBRATED.get(config.variant)
    if done is not None or not config.calibrate:
        return done if done is not None else state.resolve(config).routes
    rt = state.resolve(config)
    params = {"features": list(features), "rounds": rounds, "vocab": vocab, "stream_mb": stream_mb}
    token = state.pin(rt)  # the timed calls run on this configuration's ops
    try:
        routes = _stored(rt, params)
        source = "kept"
        if routes is None:
            routes, source = _calibrate(rt, features, rounds, vocab, stream_mb), "timed"
            verdicts.store(config, "routes", params, _as_record(routes))
    finally:
        state.unpin(token)
    state.CALIBRATED[config.variant] = routes
    log.info("specdec kernels (%s): routes per block size 1..%d: %s; %d-%d rows in chunks: %s; attention kernel "
             "per (rows, keys): %s", source, MAX_ROWS, routes.linear, MAX_ROWS + 1, CHUNK_ROWS, routes.chunked,
             None if routes.attention is None else dict(routes.attention))
    return routes


def _as_record(routes: Routes) -> dict:
    """``routes`` as JSON: {"linear": [route per size], "chunked": bool, "attention": [[rows, keys, kernel], ...]}."""
    points = [[r, k, bool(v)] for (r, k), v in sorted((routes.attention or {}).items())]
    return {"linear": list(routes.linear), "chunked": bool(routes.chunked), "attention": points}


def _from_record(record, rt: Active) -> Routes | None:
    """The routes a stored record holds, or None where it is not a whole verdict this build can run: a size
    missing, a route this build lacks (the kernel's, its wide shape), a calibration point missing or extra."""
    try:
        linear, chunked, points = tuple(record["linear"]), record["chunked"], record["attention"]
        attention = {(int(r), int(k)): v for r, k, v in points}
    except (KeyError, TypeError, ValueError):
        return None
    built = {"linear", "mm"}
    if rt.ops is not None:
        built |= {"packed", "wide"} if rt.ops.has_wide() else {"packed"}
    grid = {(r, k) for r in ATTENTION_POINTS[0] for k in ATTENTION_POINTS[1]} if rt.ops is not None else set()
    if (len(linear) != MAX_ROWS or not set(linear) <= built or not isinstance(chunked, bool)
            or set(attention) != grid or not all(isinstance(v, bool) for v in attention.values())):
        return None
    return Routes(linear, chunked, state.frozen_points(attention))


def _stored(rt: Active, params: dict) -> Routes | None:
    """The verdict kept for this machine, build and ``params`` if it reads back whole and passes its spot
    check; None (time them) otherwise."""
    record = verdicts.load(rt.config, "routes", params)
    routes = None if record is None else _from_record(record, rt)
    if record is not None and routes is None:
        log.warning("specdec: the kept self-check's routes do not fit this build; timing them again")
    if routes is not None and not spot_check(routes, rt):
        log.warning("specdec: a kernel route of the kept self-check disagrees with torch on a spot check; "
                    "timing the routes again")
        return None
    return routes


def _close(y: torch.Tensor | None, ref: torch.Tensor) -> bool:
    """y equals ref to fp32 summation rounding (the same products in another order)."""
    return (y is not None and y.shape == ref.shape and bool(torch.isfinite(y).all())
            and (y - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item()))


def spot_check(routes: Routes, rt: Active) -> bool:
    """Whether every kernel route ``routes`` names computes what torch computes, on small random inputs:
    each block size 1..MAX_ROWS by its route on a [40, 48] weight, a block past MAX_ROWS in chunks (if
    chunked), and the attention kernel at each calibration point where it is taken, against SDPA.
    Milliseconds: a stored verdict's check that its routes are right on this build (their speed is the
    timing's, which is not repeated)."""
    g = torch.Generator().manual_seed(0)
    f32 = dict(generator=g, dtype=torch.float32)  # whatever the default dtype: the kernels take fp32 only
    checked = Active(rt.config, rt.ops, routes, MAX_ROWS)
    # normal tensors even inside a generation's inference mode: the pack is written into the slab outside it
    with torch.inference_mode(False), torch.no_grad():
        scratch = Slabs(hugepages=False)
        w = _uniform((40, 48), g, scratch)
        if rt.ops is not None and any(r in KERNEL_ROUTES for r in routes.linear):
            lin.pack(w, checked, scratch)  # its pack cut from the scratch slabs, freed with them
    token = state.pin(checked)
    try:
        with torch.inference_mode():
            for m, route in enumerate(routes.linear, start=1):
                x = torch.randn(m, w.shape[1], **f32)
                if route != "linear" and not _close(lin._route(x, w, route), F.linear(x, w)):
                    return False
            x = torch.randn(2 * MAX_ROWS + 1, w.shape[1], **f32)
            if routes.chunked and not _close(lin.linear(x, w), F.linear(x, w)):
                return False
            for (rows, keys), kernel in sorted((routes.attention or {}).items()):
                if not kernel:
                    continue
                q, k, v = (torch.randn(1, 3, n, 64, **f32) for n in (rows, keys, keys))
                bias = torch.zeros(1, 1, rows, keys, dtype=torch.float32)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.125)
                if not _close(rt.ops.attention(q, k, v, bias, 0.125), ref):
                    return False
    finally:
        state.unpin(token)
    return True


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
