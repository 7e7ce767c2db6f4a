"""Linear layers over a few rows on CPU: the weights streamed at memory speed, not MKL's slow paths.

Decode and verify steps multiply 1-16 rows by every weight matrix of the model, so they are bound by
how fast the weights stream from memory. On this project's machines (torch's MKL, fp32, 2 threads)
``F.linear`` streams them at 5-10 GB/s for 1-16 rows; two routes do better:

- 1-4 rows: ``torch.mm(W, x.T)``, MKL's GEMM with the rows as 2-4 right-hand columns (an odd count
  padded with a zero row: one row alone would take MKL's GEMV again), 20-30 GB/s;
- 5-16 rows: ``specdec/csrc/packed_linear.cpp``, a kernel over a copy of the weight packed in panels
  of 16 output features (built on first use with torch's C++ extension tools; the packed copy is
  made when ``skinny_linears`` routes the module, or at a direct caller's first 5-16 row block, and
  kept while the weight lives: the model's fp32 weights once more in memory). Without a compiler
  these blocks take ``F.linear`` (a warning says so).

Microseconds per matrix, cold caches (30 copies; 2026-11-23, 2 threads), F.linear / mm(W, x.T) /
packed kernel:

    rows                1              2              4              8             16
    gate 1536x576   317/316/172    498/129/176    449/146/203    347/243/193    423/372/303
    down 576x1536   239/248/154    351/137/159    364/304/179    302/479/176    425/377/386
    lm_head (ms)   13.7/11.7/6.0  24.5/3.7/5.2   17.3/5.2/6.8   16.4/7.8/6.1   22.9/17.1/9.4

Same products, another summation order: results agree with F.linear to fp32 rounding, as a
batched forward already differs from one row at a time. Only plain ``nn.Linear`` modules (and
callers of ``linear``) with fp32 weights on CPU are routed; everything else runs untouched, and a
block that needs gradients keeps F.linear's autograd.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import weakref
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ROWS = 16  # blocks up to this many rows take a fast path (0 turns them all off)
MM_ROWS = 4  # up to here W @ x^T (MKL's skinny GEMM); past it the packed kernel
_SOURCE = Path(__file__).parent / "csrc" / "packed_linear.cpp"
log = logging.getLogger(__name__)


def _skinny(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K]^T -> [M, N] for M <= 4 as W @ x^T (an odd M padded with a zero row)."""
    m = x2.shape[0]
    if m % 2:
        x2 = torch.cat([x2, x2.new_zeros(1, x2.shape[1])])
    return torch.mm(weight, x2.t()).t()[:m]


@cache
def extension():
    """The compiled ops (``torch.ops.specdec_kernels``), built on first use, or None if they can't be."""
    try:
        from torch.utils.cpp_extension import load

        from specdec.models import cache_root

        if shutil.which("ninja") is None:  # pip's ninja is not on PATH in a venv that is not activated
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
        build = cache_root() / "torch_extensions" / f"packed_linear-{key}"
        build.mkdir(parents=True, exist_ok=True)
        load(name=f"specdec_packed_linear_{key}", sources=[str(_SOURCE)], build_directory=str(build),
             extra_cflags=["-O3", "-march=native"], is_python_module=False, verbose=False)
        return torch.ops.specdec_kernels
    except Exception as e:  # no compiler, no ninja, an unknown -march: torch's path still works
        log.warning("specdec: the packed linear kernel could not be built (%s); blocks of %d-%d rows "
                    "use F.linear", str(e).splitlines()[0] if str(e) else type(e).__name__, MM_ROWS + 1, MAX_ROWS)
        return None


# weight id -> (weakref to the weight, its version, packed copy); dropped when the weight is
_packs: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed for the kernel (made once per weight and version), or None without one."""
    ops = extension()
    if ops is None:
        return None
    version = 0 if weight.is_inference() else weight._version  # inference tensors keep no version
    entry = _packs.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == version:
        return entry[2]
    with torch.inference_mode(False), torch.no_grad():
        p = ops.pack(weight.detach())
    _packs[id(weight)] = (weakref.ref(weight, lambda _, k=id(weight): _packs.pop(k, None)), version, p)
    return p


def _packed_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """[M, K] x [N, K]^T -> [M, N] for 1 <= M <= 16 through the packed kernel; None without it."""
    wp = packed(weight)
    return None if wp is None else extension().linear(x2, wp, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through a fast path for blocks of <= max_rows rows on CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > min(max_rows, MAX_ROWS) or x.device.type != "cpu" or weight.dtype != torch.float32
            or x.dtype != torch.float32 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows <= MM_ROWS:
        y = _skinny(x2, weight)
    else:
        y = _packed_linear(x2, weight)
        if y is None:  # no kernel on this machine
            return F.linear(x, weight, bias)
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias, max_rows)


@contextmanager
def skinny_linears(*roots: nn.Module, max_rows: int = MAX_ROWS):
    """Route every plain ``nn.Linear`` under ``roots`` through ``linear`` while the block runs.

    The modules are patched per instance (no Python in the other ops of the forward) and restored
    on exit; a module another ``skinny_linears`` already patched is left to that one. Their fp32 CPU
    weights are packed for the kernel here, once per weight (not in the middle of a timed step).
    """
    patched = []
    if max_rows > 0:
        for root in roots:
            for m in root.modules():
                if type(m) is nn.Linear and "forward" not in m.__dict__:
                    m.forward = partial(_forward, m, max_rows)
                    patched.append(m)
                    if max_rows > MM_ROWS and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
                        packed(m.weight)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
