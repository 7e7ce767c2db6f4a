"""The CPU kernels' public face: few-row linears, decode/verify attention, their build and self-check.

Decode and verify steps multiply 1-16 rows by every weight of the model and attend a few rows over a
long KV store: both are bound by how fast memory streams. The runtime routes each such call through
the fastest of torch's paths and the compiled kernels in ``csrc/`` on this machine:

- ``linear`` (``specdec.runtime.linear``): F.linear, MKL's ``W @ x^T`` or the packed kernel per block
  size 1..MAX_ROWS, balanced chunks of those up to CHUNK_ROWS; ``specdec.patch.skinny_linears`` routes a model's
  ``nn.Linear`` modules for a generation (docs/decisions/002-linear-routes.md);
- ``attention`` (``specdec.runtime.attention``): grouped query rows per KV head through the kernel
  where it beats SDPA (docs/decisions/003-attention-kernel.md);
- ``qlinear.linear`` (``specdec.runtime.qlinear``): a ``QuantLinear``'s few-row forward straight from
  its GGUF blocks, per format where its self-check finds it right and faster than the reference
  (docs/decisions/015-quant-kernels.md);
- the build per variant (``specdec.runtime.build``), packed weights on huge pages
  (``specdec.runtime.memory``), the self-check (``specdec.runtime.calibrate``: a frozen ``Routes`` per
  process and variant).

What runs is a ``RuntimeConfig`` (``specdec.config``): ``kernel`` native / avx2 / off, ``calibrate``,
``attention`` auto / sdpa, ``hugepages``; until the self-check ran (or with ``calibrate=False``) 1-4 rows
take ``W @ x^T`` and 5-16 the kernel. ``SpecDecoder`` calibrates before its first generation.
"""

from __future__ import annotations

import torch

from specdec.config import RuntimeConfig, current, use
from specdec.runtime.attention import ATTENTION_POINTS, ATTENTION_ROWS, attention, attention_op
from specdec.runtime.build import VARIANTS, extension
from specdec.runtime.calibrate import calibrate, fastest_routes
from specdec.runtime.linear import chunks, linear, max_rows, packed, plan, prepack
from specdec.runtime.memory import HUGE_PAGE, Slabs, huge_empty
from specdec.runtime import state
from specdec.runtime.state import CHUNK_ROWS, KERNEL_ROUTES, MAX_ROWS, MM_ROWS, ROUTES, Routes, resolve
from specdec.sampling import greedy

__all__ = ["ATTENTION_POINTS", "ATTENTION_ROWS", "CHUNK_ROWS", "HUGE_PAGE", "KERNEL_ROUTES", "MAX_ROWS", "MM_ROWS",
           "ROUTES", "VARIANTS", "Routes", "RuntimeConfig", "Slabs", "argmax", "attention", "attention_op", "calibrate",
           "chunks", "extension", "fastest_routes", "huge_empty", "linear", "mask_rows_", "max_rows", "packed", "plan",
           "prepack", "prepare", "routes", "use", "variant"]


def variant(config: RuntimeConfig | None = None) -> str | None:
    """The kernel variant of ``config`` (default: the configuration in force); None when off."""
    return (current() if config is None else config).variant


def routes(config: RuntimeConfig | None = None) -> tuple[str, ...]:
    """The route each block size 1..MAX_ROWS takes (index 0 = 1 row) under ``config``, as things stand
    (calibrated, or not yet)."""
    return resolve(current() if config is None else config).routes.linear


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``specdec.sampling.greedy(x)``: each row's first maximum (a row with a NaN: its first NaN), by the build's
    op inside a generation's block for fp32 CPU rows (why: docs/decisions/015-quant-kernels.md, Decision:
    greedy verify: argmax and walk), else by torch."""
    rt = state.pinned()
    if (rt is None or rt.ops is None or not hasattr(rt.ops, "argmax_rows") or x.dtype != torch.float32
            or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] == 0 or not x.is_contiguous()):
        return greedy(x)
    return rt.ops.argmax_rows(x)


def mask_rows_(x: torch.Tensor, bits: torch.Tensor, allowed) -> torch.Tensor:
    """x [R, V] with -inf where llguidance's bitmask ``bits`` [R, ceil(V / 32)] forbids a token, in place: the
    build's op inside a generation for fp32 CPU rows (why: its comment in csrc/layer_ops.cpp), else torch's
    masked_fill over ``allowed()`` (the unpacked [R, V] bools, made only then)."""
    rt = state.pinned()
    if (rt is None or rt.ops is None or not hasattr(rt.ops, "mask_rows_") or x.dtype != torch.float32
            or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous()):
        return x.masked_fill_(~allowed(), float("-inf"))
    return rt.ops.mask_rows_(x, bits.contiguous())


def prepare(config: RuntimeConfig | None = None) -> Routes:
    """Build (or load) the kernel and calibrate the routes now, before any clock starts."""
    config = current() if config is None else config
    extension(config)
    return calibrate(config)
