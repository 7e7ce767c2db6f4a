"""Linear layers over a few rows on CPU: the weights streamed at memory speed, not MKL's slow paths.

Decode and verify steps multiply 1-16 rows by every weight matrix of the model, so they are bound by
how fast the weights stream from memory. Each block size takes one of ``ROUTES``:

- ``linear``: ``F.linear`` (torch's own path; it wins every tie);
- ``mm``: ``torch.mm(W, x.T)``, MKL's GEMM with the rows as right-hand columns (an odd count padded
  with a zero row: one row alone would take MKL's GEMV again);
- ``packed`` / ``wide``: ``csrc/packed_linear.cpp`` over a copy of the weight packed in panels of 8
  (AVX2) or 16 (AVX-512) output features, one panel at a time or (AVX-512) two side by side. The copy
  is made when ``skinny_linears`` routes the module, or at a direct caller's first block, and kept in
  huge-page slabs while the weight lives.

Which route a size takes is the self-check's (``calibrate``) verdict on this machine, never trusted
blindly from another: docs/decisions/002-linear-routes.md. Blocks of MAX_ROWS + 1 .. CHUNK_ROWS rows run
as the fewest balanced chunks of <= MAX_ROWS rows where chunks won the self-check.

Same products, another summation order: results agree with F.linear to fp32 rounding, as a batched
forward already differs from one row at a time. Only plain ``nn.Linear`` modules (and callers of
``linear``) with fp32 weights on CPU are routed; everything else runs untouched, and a block that needs
gradients keeps F.linear's autograd.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.runtime import state
from specdec.runtime.memory import Slabs
from specdec.runtime.state import CHUNK_ROWS, KERNEL_ROUTES, MAX_ROWS, ROUTES, Active


def _skinny(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K]^T -> [M, N] for M <= 4 as W @ x^T (an odd M padded with a zero row)."""
    m = x2.shape[0]
    if m % 2:
        x2 = torch.cat([x2, x2.new_zeros(1, x2.shape[1])])
    return torch.mm(weight, x2.t()).t()[:m]


# (weight id, variant) -> (weakref to the weight, its version, packed copy); dropped with the weight
_packs: dict[tuple[int, str], tuple[weakref.ref, int, torch.Tensor]] = {}
_slabs = {True: Slabs(hugepages=True), False: Slabs(hugepages=False)}  # by RuntimeConfig.hugepages


def packed(weight: torch.Tensor, rt: Active | None = None) -> torch.Tensor | None:
    """The weight packed for the kernel of ``rt`` (default: the record in force), made once per weight
    and version; None without a kernel."""
    rt = state.active() if rt is None else rt
    return None if rt.ops is None else pack(weight, rt)


def pack(weight: torch.Tensor, rt: Active, slabs: Slabs | None = None) -> torch.Tensor:
    """``packed`` for a record with a kernel; a first packing is cut from ``slabs`` (default: the
    process's, by ``rt.config.hugepages``)."""
    version = 0 if weight.is_inference() else weight._version  # inference tensors keep no version
    key = (id(weight), rt.config.kernel)
    entry = _packs.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == version:
        return entry[2]
    slabs = _slabs[rt.config.hugepages] if slabs is None else slabs
    with torch.inference_mode(False), torch.no_grad():
        p = rt.ops.pack(weight.detach())  # fp32 on CPU (the op takes nothing else)
        p = slabs.take(p.numel()).view(p.shape).copy_(p)
    _packs[key] = (weakref.ref(weight, lambda _, k=key: _packs.pop(k, None)), version, p)
    return p


def _packed_linear(x2: torch.Tensor, weight: torch.Tensor, wide: bool = False) -> torch.Tensor | None:
    """[M, K] x [N, K]^T -> [M, N] for 1 <= M <= 16 through the packed kernel (its wide shape if
    ``wide``, where the build has one); None without it."""
    rt = state.active()
    return None if rt.ops is None else rt.ops.linear(x2, pack(weight, rt), weight.shape[0], wide)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through a fast path for blocks of <= max_rows rows on CPU
    (past ``MAX_ROWS`` rows, up to ``CHUNK_ROWS``, as balanced chunks: ``chunks``)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > max_rows or rows > CHUNK_ROWS or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    if rows <= MAX_ROWS:  # the step's common case, kept short: this runs ~120 times a forward
        route = state.active().routes.linear[rows - 1]
        y = None if route == "linear" else _route(x.reshape(rows, x.shape[-1]), weight, route)
    else:  # balanced chunks, each by its size's route (``plan``: F.linear's over the block if any is)
        x2 = x.reshape(rows, x.shape[-1])
        steps = plan(rows, max_rows)
        parts = [_route(x2[a:b], weight, ROUTES[r]) for a, b, r in zip(steps[0::3], steps[1::3], steps[2::3])]
        y = None if any(p is None for p in parts) else torch.cat(parts)
    if y is None:  # F.linear's route for a size, or no kernel on this machine
        return F.linear(x, weight, bias)
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def plan(rows: int, max_rows: int) -> list[int]:
    """How ``linear`` runs a block of ``rows`` rows (its chunks past MAX_ROWS, and a compiled caller that
    runs the routes itself: ``csrc/layers.cpp``): [start, end, route] per chunk of rows, route = its index
    in ROUTES (0: F.linear over the whole block). Example (routes packed for 16 rows and 9, wide for 8):
    17 rows -> [0, 9, 2, 9, 17, 3]; past max_rows -> [0, rows, 0]."""
    routes = state.active().routes
    if rows == 0 or rows > max_rows or rows > CHUNK_ROWS or (rows > MAX_ROWS and not routes.chunked):
        return [0, rows, 0]
    parts = [(0, rows)] if rows <= MAX_ROWS else chunks(rows)
    ids = [ROUTES.index(routes.linear[b - a - 1]) for a, b in parts]
    if 0 in ids:  # ``linear`` runs F.linear over the whole block if any chunk's route is F.linear's
        return [0, rows, 0]
    return [v for (a, b), i in zip(parts, ids) for v in (a, b, i)]


def chunks(rows: int) -> list[tuple[int, int]]:
    """[start, end) of the fewest balanced chunks of <= MAX_ROWS rows: each chunk streams the weights
    once, and 9 + 8 rows cost less than 16 + 1 (two packed blocks, not one and MKL's GEMV).
    Example: 16 -> [(0, 16)]; 17 -> [(0, 9), (9, 17)]; 40 -> [(0, 14), (14, 28), (28, 40)]."""
    n = -(-rows // MAX_ROWS)
    size = -(-rows // n)
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]


def _route(x2: torch.Tensor, weight: torch.Tensor, route: str | None = None) -> torch.Tensor | None:
    """[M, K] x [N, K]^T for 1 <= M <= MAX_ROWS by ``route`` (default: the one in force for M rows);
    None for F.linear's."""
    route = route or state.active().routes.linear[x2.shape[0] - 1]
    if route == "mm":
        return _skinny(x2, weight)
    return _packed_linear(x2, weight, route == "wide") if route in KERNEL_ROUTES else None


def prepack(weights, max_rows: int = MAX_ROWS) -> None:
    """Pack fp32 CPU weights for the kernel now, if some block size up to max_rows routes to it (a
    direct caller of ``linear`` would otherwise pack at its first block, inside a timed step)."""
    rt = state.active()
    if any(r in KERNEL_ROUTES for r in rt.routes.linear[:max_rows]):
        for w in weights:
            if w.dtype == torch.float32 and w.device.type == "cpu":
                packed(w, rt)


def max_rows() -> int:
    """The max_rows of the innermost ``skinny_linears`` block running (0 outside any: torch's linears):
    what a direct caller of ``linear`` that follows the block (``fastpath``) passes on."""
    pinned = state.pinned()
    return 0 if pinned is None else pinned.max_rows
