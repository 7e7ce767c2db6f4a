"""What a call into the runtime routes by: the configuration in force, its compiled ops and its routes.

``Routes`` is what the self-check (``calibrate``) decides, once per process and kernel variant; until
then (or with ``RuntimeConfig(calibrate=False)``) the uncalibrated routes hold. A ``skinny_linears``
block (a generation) resolves all of it once into an ``Active`` record and pins it, so that the ~120
linear calls and ~60 attention calls of a forward each read one context variable.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from specdec.config import RuntimeConfig, current
from specdec.runtime.build import extension

MAX_ROWS = 16  # blocks up to this many rows take a fast path
# blocks of MAX_ROWS + 1 .. CHUNK_ROWS rows run as balanced chunks of <= MAX_ROWS rows, each by its
# size's route, where the self-check finds chunks beat F.linear (docs/decisions/002-linear-routes.md);
# longer blocks (prefills) keep F.linear
CHUNK_ROWS = 128
MM_ROWS = 4  # uncalibrated: up to here W @ x^T (MKL's skinny GEMM); past it the packed kernel
# F.linear, W @ x^T, the packed kernel, and its wide shape (AVX-512 builds: two panels side by side)
ROUTES = ("linear", "mm", "packed", "wide")
KERNEL_ROUTES = ("packed", "wide")  # the routes that run the packed kernel (on its packed weights)


@dataclass(frozen=True)
class Routes:
    linear: tuple[str, ...]  # [MAX_ROWS] the route of each block size 1..MAX_ROWS (index 0: 1 row)
    chunked: bool  # blocks of MAX_ROWS + 1 .. CHUNK_ROWS rows run in chunks (else F.linear over them)
    # (rows, keys) calibration point -> the attention kernel beat SDPA there; None: uncalibrated (the
    # kernel wherever it takes the call)
    attention: Mapping[tuple[int, int], bool] | None = None


def uncalibrated(built: bool) -> Routes:
    """1-4 rows W @ x^T, 5-16 the packed kernel (F.linear without a build), chunks where it is built."""
    kernel = "packed" if built else "linear"
    return Routes(tuple("mm" if m <= MM_ROWS else kernel for m in range(1, MAX_ROWS + 1)), built)


def frozen_points(points: Mapping[tuple[int, int], bool]) -> Mapping[tuple[int, int], bool]:
    return MappingProxyType(dict(points))


# kernel variant (None: off) -> its routes, once calibrated in this process (``calibrate``)
CALIBRATED: dict[str | None, Routes] = {}


@dataclass(frozen=True)
class Active:
    config: RuntimeConfig
    ops: object | None  # the compiled ops of config's variant (None: off, or no build)
    routes: Routes
    max_rows: int = 0  # the innermost skinny_linears block's (0 outside any: torch's linears)


_active: contextvars.ContextVar[Active | None] = contextvars.ContextVar("specdec_runtime_active", default=None)


def resolve(config: RuntimeConfig, max_rows: int = 0) -> Active:
    """``config`` with its ops and its routes as they stand now."""
    ops = extension(config)
    routes = CALIBRATED.get(config.variant)
    return Active(config, ops, routes if routes is not None else uncalibrated(ops is not None), max_rows)


def active() -> Active:
    """The record pinned by the innermost ``skinny_linears`` block, else the configuration in force
    resolved now (a direct caller outside any generation)."""
    pinned = _active.get()
    return pinned if pinned is not None else resolve(current())


def config() -> RuntimeConfig:
    """The configuration in force: the pinned block's, else ``specdec.config.current()``."""
    pinned = _active.get()
    return pinned.config if pinned is not None else current()


def pinned() -> Active | None:
    """The record of the innermost ``skinny_linears`` block running, or None outside any."""
    return _active.get()


def pin(record: Active) -> contextvars.Token:
    return _active.set(record)


def unpin(token: contextvars.Token) -> None:
    _active.reset(token)
