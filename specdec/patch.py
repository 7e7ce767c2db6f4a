"""Routing a model's ``nn.Linear`` modules through ``linear`` for a block (a generation)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn

from specdec.config import RuntimeConfig, current
from specdec.quant.modules import QuantLinear
from specdec.runtime import linear as lin
from specdec.runtime import qlinear
from specdec.runtime import state
from specdec.runtime.calibrate import calibrate
from specdec.runtime.state import MAX_ROWS


def _forward(module: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    return lin.linear(x, module.weight, module.bias, max_rows)


@contextmanager
def skinny_linears(*roots: nn.Module, max_rows: int = MAX_ROWS, skip=(), runtime: RuntimeConfig | None = None,
                   drafts: bool = False):
    """Route every plain ``nn.Linear`` under ``roots`` through ``linear`` while the block runs, under
    ``runtime`` (default: the configuration in force).

    The routes are calibrated first (once per process and variant, before any timed step; the block
    kernel's too, for the formats of the ``QuantLinear`` layers under ``roots``, and with ``drafts`` the int8
    route of a drafter's approximate forwards over them) and pinned
    with the configuration and its ops for the block (a generation), so no call looks them up again.
    The modules are patched per instance (no Python in the other ops of the forward) and restored
    on exit; a module another ``skinny_linears`` already patched is left to that one, and so are the
    modules in ``skip`` (linears a ``fastpath.FastPath`` replaced by fused copies: not packed twice).
    Their fp32 CPU weights are packed for the kernel here, once per weight (not in the middle of a
    timed step).
    """
    config = current() if runtime is None else runtime
    if max_rows > 0:
        calibrate(config)  # once per process and variant, before any timed step
        qlinear.prepare({m.fmt for root in roots for m in root.modules() if isinstance(m, QuantLinear)}, config,
                        drafts)
    token = state.pin(state.resolve(config, max_rows))
    patched = []
    skip = {id(m) for m in skip}
    try:
        for m in (m for root in roots for m in root.modules()) if max_rows > 0 else ():
            if type(m) is nn.Linear and "forward" not in m.__dict__ and id(m) not in skip:
                m.forward = partial(_forward, m, max_rows)
                patched.append(m)
                lin.prepack([m.weight], max_rows)
        yield
    finally:
        for m in patched:
            del m.forward
        state.unpin(token)
