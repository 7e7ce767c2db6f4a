"""Linear layers over a few rows on CPU: MKL's skinny-GEMM path instead of its slow GEMV.

Decode and verify steps multiply 1-8 rows by every weight matrix of the model, so they are bound by
how fast the weights stream from memory. On this project's machines (torch's MKL, fp32, 2 threads)
``F.linear`` streams them at about half the rate ``torch.mm(W, x.T)`` reaches over 2-4 rows.
Measured on weights shaped like the default model's (30 copies each, so caches stay cold),
microseconds per matrix (`F.linear` / `torch.mm(W, x.T)`):

    rows                      1          2          3          4          8
    gate/up 1536x576     338 / 338  609 / 188  570 / 150  462 / 188  386 / 480
    down     576x1536    230 / 231  344 / 218  519 / 338  412 / 310  296 / 368

So a block of up to ``max_rows`` rows is computed as ``W @ x^T`` in chunks of at most 4 rows. One
row alone would take MKL's GEMV again, so an odd chunk gets a zero row (2 rows cost what 1 costs).
Past 4 rows F.linear's general GEMM is about as fast and is used as is. On the whole default model
(2 threads, 200-token context) a 1-token forward takes ~25% less time and a 2-4 token verify block costs
about what one token did before; ``specdec bench-verify`` shows the curve before and after.

Same products, another summation order: results agree with F.linear to fp32 rounding, as a
batched forward already differs from one row at a time. Only plain ``nn.Linear`` modules with fp32
weights on CPU are routed; everything else runs untouched.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ROWS = 4  # blocks up to this many rows take the skinny path (0 turns it off)
_CHUNK = 4  # MKL's skinny path covers up to 4 right-hand columns


def _skinny(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K]^T -> [M, N] for M <= 4 as W @ x^T (an odd M padded with a zero row)."""
    m = x2.shape[0]
    if m % 2:
        x2 = torch.cat([x2, x2.new_zeros(1, x2.shape[1])])
    return torch.mm(weight, x2.t()).t()[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the skinny path for blocks of <= max_rows rows on CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > max_rows or x.device.type != "cpu" or weight.dtype != torch.float32
            or x.dtype != torch.float32 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    y = torch.cat([_skinny(c, weight) for c in x2.split(_CHUNK)]) if rows > _CHUNK else _skinny(x2, weight)
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias, max_rows)


@contextmanager
def skinny_linears(*roots: nn.Module, max_rows: int = MAX_ROWS):
    """Route every plain ``nn.Linear`` under ``roots`` through ``linear`` while the block runs.

    The modules are patched per instance (no Python in the other ops of the forward) and restored
    on exit; a module another ``skinny_linears`` already patched is left to that one.
    """
    patched = []
    if max_rows > 0:
        for root in roots:
            for m in root.modules():
                if type(m) is nn.Linear and "forward" not in m.__dict__:
                    m.forward = partial(_forward, m, max_rows)
                    patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
