"""Memory for the packed weights: slabs of transparent huge pages (2 MB, x86-64 Linux); and the C
allocator's freed pages handed back to the system (``malloc_trim``).

A step streams every weight once; on 2 MB pages it takes fewer TLB misses than on 4 KB ones
(docs/decisions/004-lean-forward.md). Linux hands huge pages to regions marked MADV_HUGEPAGE where
transparent_hugepage is "madvise" or "always"; elsewhere, or with ``RuntimeConfig(hugepages=False)``,
the slabs are ordinary memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

import torch

HUGE_PAGE = 2 << 20  # bytes
SLAB_BYTES = 64 << 20  # one slab holds many packed weights (past glibc's mmap threshold: fresh pages)
_MADV_HUGEPAGE = 14


@cache
def malloc_trim():
    """glibc's ``malloc_trim(0)`` as a function of no arguments (free pages of every arena back to the
    system), or None where the C library has none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


@cache
def _madvise(enabled: bool = True):
    """libc's madvise, or None (not Linux, or huge pages turned off)."""
    if not enabled or not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_empty(numel: int, hugepages: bool = True) -> torch.Tensor:
    """An uninitialised float32 [numel] tensor on CPU, 2 MB-aligned and (``hugepages``) marked for huge
    pages before anything touches it (so its pages fault in as huge ones where the OS allows)."""
    size = -(-numel * 4 // HUGE_PAGE) * HUGE_PAGE
    base = torch.empty((size + HUGE_PAGE) // 4, dtype=torch.float32, device="cpu")
    start = (-base.data_ptr()) % HUGE_PAGE // 4
    t = base[start:start + size // 4]
    madvise = _madvise(hugepages)
    if madvise is not None:
        madvise(t.data_ptr(), size, _MADV_HUGEPAGE)  # advice only: a refusal leaves ordinary pages
    return t[:numel]


class Slabs:
    """A bump allocator of float32 tensors (64-byte aligned) over ``huge_empty`` slabs; a slab is freed
    when the last tensor cut from it (and the allocator, for its current slab) lets go."""

    def __init__(self, slab_bytes: int = SLAB_BYTES, hugepages: bool = True) -> None:
        self.slab_bytes = slab_bytes
        self.hugepages = hugepages
        self._slab: torch.Tensor | None = None
        self._used = 0

    def take(self, numel: int) -> torch.Tensor:
        step = -(-numel // 16) * 16
        if self._slab is None or self._used + step > self._slab.numel():
            self._slab, self._used = huge_empty(max(self.slab_bytes // 4, step), self.hugepages), 0
        t = self._slab[self._used:self._used + numel]
        self._used += step
        return t
