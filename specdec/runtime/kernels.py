"""Linear layers over a few rows on CPU: the weights streamed at memory speed, not MKL's slow paths.

Decode and verify steps multiply 1-16 rows by every weight matrix of the model, so they are bound by
how fast the weights stream from memory. On this project's machines (torch's MKL, fp32, 2 threads)
``F.linear`` streams them at 5-10 GB/s for 1-16 rows; two routes do better:

- 1-4 rows: ``torch.mm(W, x.T)``, MKL's GEMM with the rows as 2-4 right-hand columns (an odd count
  padded with a zero row: one row alone would take MKL's GEMV again), 20-30 GB/s;
- 5-16 rows: ``specdec/runtime/csrc/packed_linear.cpp``, a kernel over a copy of the weight packed in panels
  of 8 (AVX2) or 16 (AVX-512; two shapes: one panel or two at a time) output features (built on
  first use with torch's C++ extension tools and ``-march=native``; the packed copy is made when
  ``skinny_linears`` routes the module, or at a direct caller's first block, and kept while the
  weight lives: the model's fp32 weights once more in memory). Without a compiler these blocks
  take ``F.linear`` (a warning says so).

What the kernel assumes: an x86-64 or other GCC/Clang target with vector extensions (AVX-512 gets
16-float panels, anything else 8-float panels sized for AVX2's 16 registers), fp32 weights on CPU.
Because machines differ (the AVX-512 shape was 8-15x slower than torch on an AVX2-only CPU), the
routes are not trusted blindly: ``calibrate()`` times F.linear, ``W @ x^T`` and the kernel (each
of its shapes) once per process for each block size 1..16 on weights shaped like a decoder layer's,
and every size takes its fastest route (``routes()``); ``SpecDecoder`` calibrates before its first
generation. Until then (or with ``SPECDEC_KERNEL_CALIBRATE=0``) sizes 1-4 take ``W @ x^T`` and
5-16 the kernel.
``SPECDEC_KERNEL=avx2`` builds and uses the AVX2 shape (``-march=x86-64-v3``) even on an AVX-512
machine (to measure it); ``SPECDEC_KERNEL=off`` keeps torch's paths.

Microseconds per matrix, cold caches (30 copies; 2026-11-23, 2 threads), F.linear / mm(W, x.T) /
packed kernel:

    rows                1              2              4              8             16
    gate 1536x576   317/316/172    498/129/176    449/146/203    347/243/193    423/372/303
    down 576x1536   239/248/154    351/137/159    364/304/179    302/479/176    425/377/386
    lm_head (ms)   13.7/11.7/6.0  24.5/3.7/5.2   17.3/5.2/6.8   16.4/7.8/6.1   22.9/17.1/9.4

(Those are the kernel's shapes of 2026-11-23. Since 5983ce3 the AVX-512 shape streams one panel at
a time, 8 KB prefetched ahead: the default model's linears, cold, took 14.3-14.8 ms for 1-8 rows and
21.1 ms for 16 on a Zen 4, where MKL's ``W @ x^T`` took 14.4-15.8 ms for 1-4 rows. Until 2026-11-25
the kernel was built without OpenMP, so it ran on one thread, and it prefetched as non-temporal: on
a Xeon (Sapphire Rapids class, KVM; MKL's F.linear streams at ~45 GB/s there for one row) it lost to
F.linear at every block size. Built with OpenMP and prefetching into L2, the default model's
linears there, F.linear / kernel, ms: 1 row 20.7 / 20.6, 4 rows 37.4 / 21.5, 8 rows 48.5 / 24.6,
16 rows 48.9 / 31.2. AVX-512 builds now hold a second, wide shape (two panels side by side for 3-12
rows, 13-16 rows in two passes), a route of its own that the self-check weighs per block size like
the others: on that Xeon the linears, narrow / wide, ms: 8 rows 26.3 / 23.7, 12 rows 31.2 / 25.9, 16
rows 31.2 / 29.6; a whole decoder step at 200 tokens of context 30.7 / 28.4 ms at 1 row, 38.1 / 35.7
at 8, 44.3 / 39.2 at 12, 48.1 / 46.1 at 16.)

The same build holds ``attention`` (``csrc/decode_attention.cpp``): the grouped query rows of a
decode or verify block (up to ATTENTION_ROWS per KV head) against a KV store's views, for
``forward.grouped_attention``. torch's SDPA read the store at ~12 GB/s on a Xeon whose memory streams
at ~24 GB/s; the kernel, its keys split across threads and prefetched, at 18-36 GB/s (30 layers of
the default model's K/V, 2 threads, 2026-11-25, SDPA / kernel ms: 1 row x 2,000 tokens 5.9 / 2.7,
1 x 7,000 29.7 / 14.2, B = 8 x 400 10.5 / 5.7, B = 8 x 2,000 50.9 / 31.9). With many rows over a
short context it is compute-bound, and its first shape lost to SDPA there (16 rows x 200 tokens:
0.75x; the rows-as-lanes shape since: 1.15x), so ``calibrate`` also times both at each of
ATTENTION_POINTS (rows x keys) and a call takes the nearest point's faster one, as the linears'
routes guard against a shape that suits another CPU; ``SPECDEC_ATTENTION=sdpa`` keeps SDPA.

Same products, another summation order: results agree with F.linear to fp32 rounding, as a
batched forward already differs from one row at a time. Only plain ``nn.Linear`` modules (and
callers of ``linear``) with fp32 weights on CPU are routed; everything else runs untouched, and a
block that needs gradients keeps F.linear's autograd.
"""

from __future__ import annotations

import contextvars
import ctypes
import hashlib
import logging
import math
import os
import shutil
import sys
import time
import weakref
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ROWS = 16  # blocks up to this many rows take a fast path (0 turns them all off)
# blocks of MAX_ROWS + 1 .. CHUNK_ROWS rows run as balanced chunks of <= MAX_ROWS rows, each by its
# size's route: F.linear over 17 rows streamed the weights at ~9 GB/s, so a 17-row verify (a 16-node
# tree, B = 8 x 2 rows) cost 3.6x a 1-row step against 1.9x for 16 rows (Zen 4, 800 tokens of context);
# the model's linears over 17 / 24 / 32 / 64 / 128 rows: F.linear 28.6 / 29.3 / 35.1 / 53.2 / 82.9 ms,
# chunks 11.4 / 12.8 / 17.4 / 34.0 / 67.1 (2026-11-25, 2 threads). Prefills of longer prompts keep F.linear.
CHUNK_ROWS = 128
MM_ROWS = 4  # uncalibrated: up to here W @ x^T (MKL's skinny GEMM); past it the packed kernel
_SOURCES = [Path(__file__).parent / "csrc" / f for f in ("packed_linear.cpp", "decode_attention.cpp", "layer_ops.cpp",
                                                                 "layers.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / f for f in ("vec.h", "ops.h")]  # in the build key, not compiled alone
# variant -> (compiler flags, op namespace). "native" is what this CPU supports; "avx2" forces the
# 8-float shape on any x86-64-v3 CPU, AVX-512 ones included.
VARIANTS = {"native": (["-march=native"], "specdec_kernels"),
            "avx2": (["-march=x86-64-v3"], "specdec_kernels_avx2")}
# at::parallel_for is inlined into the kernel: without OpenMP it runs every strip on the calling thread
# (one core streaming the weights: 5 GB/s on a Xeon, 23 ms for the lm_head against F.linear's 2.5 ms).
# The loader resolves libgomp.so.1 to the copy torch already loaded, so the kernel shares torch's pool.
_OPENMP = ["-fopenmp"]
# F.linear, W @ x^T, the packed kernel, and its wide shape (AVX-512 builds: two panels side by side)
ROUTES = ("linear", "mm", "packed", "wide")
KERNEL_ROUTES = ("packed", "wide")  # the routes that run the packed kernel (on its packed weights)
log = logging.getLogger(__name__)


def variant() -> str | None:
    """The kernel variant in use ($SPECDEC_KERNEL: native (default), avx2, off -> None)."""
    v = os.environ.get("SPECDEC_KERNEL", "native")
    if v == "off":
        return None
    if v not in VARIANTS:
        raise ValueError(f"SPECDEC_KERNEL={v!r}: expected one of {', '.join([*VARIANTS, 'off'])}")
    return v


def _skinny(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K]^T -> [M, N] for M <= 4 as W @ x^T (an odd M padded with a zero row)."""
    m = x2.shape[0]
    if m % 2:
        x2 = torch.cat([x2, x2.new_zeros(1, x2.shape[1])])
    return torch.mm(weight, x2.t()).t()[:m]


def extension():
    """The compiled ops of the variant in use, built on first use, or None if they can't be."""
    return _in_use()[1]


def _in_use():
    """(the variant in use, its compiled ops): ``variant()`` and ``extension()`` from one read of
    $SPECDEC_KERNEL (~0.65 us; the linear path took three a call, ~0.25 ms of a forward's 120), or
    none inside a ``skinny_linears`` block, which reads it once for the block (a generation)."""
    pinned = _pinned.get()
    if pinned is not None:
        return pinned
    v = variant()
    return v, None if v is None else _build(v)


@cache
def _build(name: str):
    """Build (or load the cached build of) a variant: with OpenMP, else (a compiler without it) on one
    thread, which the route self-check then weighs like any other route; None if neither builds."""
    try:
        if shutil.which("ninja") is None:  # pip's ninja is not on PATH in a venv that is not activated
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        try:
            return _load(name, _OPENMP)
        except Exception as e:  # noqa: BLE001
            log.warning("specdec: the packed linear kernel did not build with OpenMP (%s); building it "
                        "for one thread", _first_line(e))
            return _load(name, [])
    except Exception as e:  # no compiler, no ninja, an unknown -march: torch's path still works
        log.warning("specdec: the packed linear kernel could not be built (%s); blocks of %d-%d rows "
                    "use F.linear", _first_line(e), MM_ROWS + 1, MAX_ROWS)
        return None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _load(name: str, openmp: list[str]):
    from torch.utils.cpp_extension import load

    from specdec.models import cache_root

    flags, ns = VARIANTS[name]
    key = hashlib.sha256(b"".join(f.read_bytes() for f in _SOURCES + _HEADERS) + torch.__version__.encode() + " ".join([name, *flags, *openmp]).encode()
                         ).hexdigest()[:16]
    build = cache_root() / "torch_extensions" / f"packed_linear-{key}"
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):  # say it once: the build takes ~20 s and is not generation time
        print(f"specdec: building the CPU kernel ({name}, once, ~20 s) ...", file=sys.stderr, flush=True)
    load(name=f"specdec_packed_linear_{key}", sources=[str(f) for f in _SOURCES], build_directory=str(build),
         extra_cflags=["-O3", *flags, *openmp, f"-DSPECDEC_OPS={ns}"], extra_ldflags=openmp,
         is_python_module=False, verbose=False)
    return getattr(torch.ops, ns)


# 0 outside any skinny_linears block: there a direct caller that follows it (fastpath) takes torch's
# linears, as HF's unpatched modules would
_max_rows: contextvars.ContextVar[int] = contextvars.ContextVar("specdec_max_rows", default=0)
# (variant, ops) read once by the innermost ``skinny_linears`` block running, for its linears' calls
_pinned: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("specdec_pinned_variant", default=None)
_routes: tuple[str, ...] | None = None  # route per block size 1..MAX_ROWS, once calibrated
_chunked: bool | None = None  # whether chunks beat F.linear past MAX_ROWS rows, once calibrated


def routes() -> tuple[str, ...]:
    """The route each block size 1..MAX_ROWS takes (index 0 = 1 row)."""
    if _routes is not None:
        return _routes
    kernel = "packed" if extension() is not None else "linear"
    return tuple("mm" if m <= MM_ROWS else kernel for m in range(1, MAX_ROWS + 1))


def fastest_routes(seconds: dict[str, list[float]]) -> tuple[str, ...]:
    """Per block size, the route with the least time; torch's F.linear wins ties.

    seconds: route -> [MAX_ROWS] median seconds for 1..MAX_ROWS rows (a missing route is not built).
    Example: {"linear": [3, 3], "mm": [2, 3], "packed": [1, 9]} -> ("packed", "linear").
    """
    order = [r for r in ROUTES if r in seconds]  # "linear" first: the tie goes to torch's own path
    n = len(seconds[order[0]])
    return tuple(min(order, key=lambda r: seconds[r][m]) for m in range(n))


def calibrate(features: tuple[int, int] = (1536, 576), rounds: int = 3, vocab: int = 16384,
              stream_mb: int = 128) -> tuple[str, ...]:
    """Time the three routes for every block size on this machine, once per process; keep the fastest.

    The weights are random [N, K] matrices (N, K = ``features``, the default model's MLP: 3.5 MB
    each) and one wide [``vocab``, K] one, the shape of a vocabulary projection, ``stream_mb`` MB in
    all, so they stream from memory as a model's weights do. 14 MB of them fitted in the last-level
    cache (32 MB a CCD on a Zen 4, more on a Xeon), where MKL's ``W @ x^T`` looked faster than it is
    from memory: the AVX2 build on a Xeon took it for 13-16 rows, 25% slower than the kernel in the
    model. On the MLP shape alone F.linear could win 1 row, and it then ran the default model's 49k-row
    lm_head at 6.4 ms against MKL's 2.3 ms (``W @ x^T``) on a Zen 4: hence the wide one.
    They are cycled so no call finds its weight cached by the previous one; rounds alternate the
    routes, and each keeps its fastest round (noise only ever adds time: a median let one busy moment
    at process start send 1-row steps down F.linear for a whole benchmark run). ~1.5-2 s, and ~0.7 s
    more for the attention kernel's points. A route that is slower than torch's own for a size is
    never used for it: that is the guard against a kernel shape that suits another CPU (see the
    module doc).
    """
    global _slabs
    if _routes is not None or os.environ.get("SPECDEC_KERNEL_CALIBRATE") == "0":
        return routes()
    model_slabs, _slabs = _slabs, Slabs()  # the random weights' packs: freed with them, not kept in a slab
    try:
        _calibrate(features, rounds, vocab, stream_mb)
    finally:
        _slabs = model_slabs
    return _routes


def _calibrate(features: tuple[int, int], rounds: int, vocab: int, stream_mb: int) -> None:
    global _routes
    g = torch.Generator().manual_seed(0)
    N, K = features
    count = max(1, -(-(stream_mb * 2**20 // 4 - vocab * K) // (N * K)))  # MLP matrices to fill stream_mb
    ws = [torch.empty(N, K).uniform_(-1, 1, generator=g) for _ in range(count)]
    ws.append(torch.empty(vocab, K).uniform_(-1, 1, generator=g))
    ops = extension()
    fns = {"linear": lambda x, w: F.linear(x, w), "mm": _skinny}
    if ops is not None:
        for w in ws:
            packed(w)
        fns["packed"] = _packed_linear
        if ops.has_wide():
            fns["wide"] = partial(_packed_linear, wide=True)
    best: dict[str, list[float]] = {r: [] for r in fns}
    for m in range(1, MAX_ROWS + 1):
        for r, t in _fastest_rounds(fns, torch.randn(m, K, generator=g), ws, rounds).items():
            best[r].append(t)
    _routes = fastest_routes(best)
    _calibrate_chunks(ws, g, rounds)
    del ws
    _calibrate_attention(g, rounds, stream_mb)
    log.info("specdec kernels: routes per block size 1..%d: %s; %d-%d rows in chunks: %s; attention kernel "
             "per (rows, keys): %s", MAX_ROWS, _routes, MAX_ROWS + 1, CHUNK_ROWS, _chunked, _attention_routes)


def _calibrate_chunks(ws: list[torch.Tensor], g: torch.Generator, rounds: int) -> None:
    """Chunks past MAX_ROWS only where they beat F.linear: timed over twice MAX_ROWS rows, fastest
    round of each (the same guard as the routes')."""
    global _chunked

    def in_chunks(x: torch.Tensor, w: torch.Tensor) -> bool | None:
        return None if any(_route(x[a:b], w) is None for a, b in chunks(len(x))) else True

    x = torch.randn(2 * MAX_ROWS, ws[0].shape[1], generator=g)
    times = _fastest_rounds({"linear": lambda x, w: F.linear(x, w), "chunks": in_chunks}, x, ws, rounds)
    _chunked = times["chunks"] < times["linear"]


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


# The attention kernel (csrc/decode_attention.cpp): grouped query rows per KV head it takes, and the
# (rows, keys) points the self-check times it at against SDPA; a call takes the verdict of the point
# with the fewest rows >= its own (the last past them) and the nearest number of keys (geometrically).
ATTENTION_ROWS = 64
ATTENTION_POINTS = ((3, 6, 12, 24, 48), (256, 2048))
_attention_routes: dict[tuple[int, int], bool] | None = None  # (rows, keys) point -> kernel faster


def _attention_point(rows: int, keys: int) -> tuple[int, int]:
    """The calibrated point a call of ``rows`` grouped rows over ``keys`` keys takes its route from.
    Example: (9, 300) -> (12, 256); (60, 5000) -> (48, 2048)."""
    grid_rows, grid_keys = ATTENTION_POINTS
    r = next((p for p in grid_rows if p >= rows), grid_rows[-1])
    k = min(grid_keys, key=lambda p: abs(math.log(keys / p)))
    return r, k


def _calibrate_attention(g: torch.Generator, rounds: int, stream_mb: int) -> None:
    """Time the attention kernel against SDPA at every (rows, keys) point, on key/value stores shaped
    like the default model's (3 KV heads of 64), ``stream_mb`` MB of them so they come from memory as
    a model's do between its layers; each point keeps the faster (SDPA on a tie)."""
    global _attention_routes
    ops = extension()
    if ops is None:
        _attention_routes = {}
        return
    routes = {}
    for keys in ATTENTION_POINTS[1]:
        per_layer = 2 * 3 * keys * 64 * 4
        layers = max(2, min(64, stream_mb * 2**20 // per_layer))
        kv = [torch.randn(2, 1, 3, keys, 64, generator=g).unbind() for _ in range(layers)]
        for rows in ATTENTION_POINTS[0]:
            q = torch.randn(1, 3, rows, 64, generator=g)
            bias = torch.zeros(1, 1, rows, keys)  # a block's mask, as the decoder hands SDPA one
            fns = {"sdpa": lambda _, kv_: F.scaled_dot_product_attention(q, *kv_, attn_mask=bias),
                   "kernel": lambda _, kv_: ops.attention(q, *kv_, bias, 0.125)}
            times = _fastest_rounds(fns, q, kv, rounds)
            routes[rows, keys] = times["kernel"] < times["sdpa"]
    _attention_routes = routes


@cache
def _head_size_supported(ops, d: int) -> bool:
    """``ops.attention_supports(d)``, asked once per build and head size (an op call, ~0.9 us, ~190
    times a forward)."""
    return ops.attention_supports(d)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> torch.Tensor | None:
    """Attention of R grouped query rows per KV head through the kernel, or None where SDPA is the
    route (another dtype or device, more than ATTENTION_ROWS rows, a head size without a shape, K/V
    rows that are not contiguous, a bias of another shape, no kernel, or the self-check found SDPA
    faster at this size).

    query [B, H, R, D]; key/value [B, H, L, D], views of a store (rows contiguous); bias additive
    [B or 1, 1, Q, L] with R a multiple of Q (row r masked by bias row r % Q: the grouped rows of one
    query position share its mask), or None. Returns [B, H, R, D].
    """
    ops = attention_op(query, key, value, bias)
    return None if ops is None else ops.attention(query, key, value, bias, scale)


def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None):
    """The compiled ops whose ``attention`` takes this call (``attention``'s arguments, its rules), or
    None for SDPA. A forward whose layers all attend alike asks once (``fastpath``), not per layer."""
    if (query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or query.shape[2] > ATTENTION_ROWS
            or key.stride(-1) != 1 or value.stride(-1) != 1
            or (bias is not None and (bias.dtype != torch.float32 or bias.dim() != 4 or bias.shape[-1] != key.shape[2]
                                      or query.shape[2] % bias.shape[2]))
            or (torch.is_grad_enabled() and query.requires_grad)):
        return None
    ops = extension()
    if ops is None or not _head_size_supported(ops, query.shape[-1]) or os.environ.get("SPECDEC_ATTENTION") == "sdpa":
        return None
    if _attention_routes is not None and not _attention_routes.get(_attention_point(query.shape[2], key.shape[2])):
        return None
    return ops


def chunking() -> bool:
    """Whether blocks of MAX_ROWS + 1 .. CHUNK_ROWS rows run in chunks (``calibrate``; before it,
    whenever the kernel is built)."""
    return _chunked if _chunked is not None else extension() is not None


# (weight id, variant) -> (weakref to the weight, its version, packed copy); dropped with the weight
_packs: dict[tuple[int, str], tuple[weakref.ref, int, torch.Tensor]] = {}

# The packed copies live in slabs of transparent huge pages (2 MB, x86-64 Linux): a step streams every
# weight once, ~130k pages of 4 KB (a plain read of all of them: 21.5 ms on 4 KB pages, 18 on 2 MB). On
# a Xeon (Sapphire Rapids class, KVM, 2 threads) the default model's linears took 21.0 -> 19.5 ms at 1
# row, 24.2 -> 22.5 at 8, 31.1 -> 30.0 at 16, and whole decoder steps at 200 tokens of context 31.5 ->
# 29.3 ms at 1 row, 37.8 -> 35.3 at 8, 51.2 -> 47.7 at 16 (one process, alternating; 2026-11-26; at
# 2,000 tokens see docs/benchmarks.md); the 1-row kernel also stopped tying with F.linear at the
# self-check. Linux hands huge pages to regions marked MADV_HUGEPAGE where transparent_hugepage is
# "madvise" or "always"; elsewhere the slabs are ordinary memory. ``SPECDEC_HUGEPAGES=off`` leaves
# them ordinary.
HUGE_PAGE = 2 << 20  # bytes
SLAB_BYTES = 64 << 20  # one slab holds many packed weights (past glibc's mmap threshold: fresh pages)
_MADV_HUGEPAGE = 14


@cache
def _madvise():
    """libc's madvise, or None (not Linux, or SPECDEC_HUGEPAGES=off)."""
    if not sys.platform.startswith("linux") or os.environ.get("SPECDEC_HUGEPAGES", "on") == "off":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_empty(numel: int) -> torch.Tensor:
    """An uninitialised float32 [numel] tensor on CPU, 2 MB-aligned and marked for huge pages before
    anything touches it (so its pages fault in as huge ones where the OS allows)."""
    size = -(-numel * 4 // HUGE_PAGE) * HUGE_PAGE
    base = torch.empty((size + HUGE_PAGE) // 4, dtype=torch.float32)
    start = (-base.data_ptr()) % HUGE_PAGE // 4
    t = base[start:start + size // 4]
    madvise = _madvise()
    if madvise is not None:
        madvise(t.data_ptr(), size, _MADV_HUGEPAGE)  # advice only: a refusal leaves ordinary pages
    return t[:numel]


class Slabs:
    """A bump allocator of float32 tensors (64-byte aligned) over ``huge_empty`` slabs; a slab is freed
    when the last tensor cut from it (and the allocator, for its current slab) lets go."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self.slab_bytes = slab_bytes
        self._slab: torch.Tensor | None = None
        self._used = 0

    def take(self, numel: int) -> torch.Tensor:
        step = -(-numel // 16) * 16
        if self._slab is None or self._used + step > self._slab.numel():
            self._slab, self._used = huge_empty(max(self.slab_bytes // 4, step)), 0
        t = self._slab[self._used:self._used + numel]
        self._used += step
        return t


_slabs = Slabs()


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed for the kernel (made once per weight and version), or None without one."""
    v, ops = _in_use()
    return None if ops is None else _packed(weight, v, ops)


def _packed(weight: torch.Tensor, v: str, ops) -> torch.Tensor:
    """``packed`` for variant ``v`` and its build ``ops``."""
    version = 0 if weight.is_inference() else weight._version  # inference tensors keep no version
    key = (id(weight), v)
    entry = _packs.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == version:
        return entry[2]
    with torch.inference_mode(False), torch.no_grad():
        p = ops.pack(weight.detach())  # fp32 on CPU (the op takes nothing else)
        p = _slabs.take(p.numel()).view(p.shape).copy_(p)
    _packs[key] = (weakref.ref(weight, lambda _, k=key: _packs.pop(k, None)), version, p)
    return p


def _packed_linear(x2: torch.Tensor, weight: torch.Tensor, wide: bool = False) -> torch.Tensor | None:
    """[M, K] x [N, K]^T -> [M, N] for 1 <= M <= 16 through the packed kernel (its wide shape if
    ``wide``, where the build has one); None without it."""
    v, ops = _in_use()
    return None if ops is None else ops.linear(x2, _packed(weight, v, ops), weight.shape[0], wide)


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
        route = routes()[rows - 1]
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
    runs the routes itself: ``csrc/layers.cpp``): [start, end, route] per chunk of rows, route = its index in ROUTES (0: F.linear
    over the whole block). Example (routes packed for 16 rows and 9, wide for 8): 17 rows -> [0, 9, 2,
    9, 17, 3]; past max_rows -> [0, rows, 0]."""
    if rows == 0 or rows > max_rows or rows > CHUNK_ROWS or (rows > MAX_ROWS and not chunking()):
        return [0, rows, 0]
    parts = [(0, rows)] if rows <= MAX_ROWS else chunks(rows)
    r = routes()
    ids = [ROUTES.index(r[b - a - 1]) for a, b in parts]
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
    """[M, K] x [N, K]^T for 1 <= M <= MAX_ROWS by ``route`` (default: the one calibrated for M rows);
    None for F.linear's."""
    route = route or routes()[x2.shape[0] - 1]
    if route == "mm":
        return _skinny(x2, weight)
    return _packed_linear(x2, weight, route == "wide") if route in KERNEL_ROUTES else None


def _forward(module: nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias, max_rows)


def prepare() -> None:
    """Build (or load) the kernel and calibrate the routes now, before any clock starts."""
    if variant() is not None:
        extension()
    calibrate()


def prepack(weights, max_rows: int = MAX_ROWS) -> None:
    """Pack fp32 CPU weights for the kernel now, if some block size up to max_rows routes to it (a
    direct caller of ``linear`` would otherwise pack at its first block, inside a timed step)."""
    if any(r in KERNEL_ROUTES for r in routes()[:max_rows]):
        for w in weights:
            if w.dtype == torch.float32 and w.device.type == "cpu":
                packed(w)


@contextmanager
def skinny_linears(*roots: nn.Module, max_rows: int = MAX_ROWS, skip=()):
    """Route every plain ``nn.Linear`` under ``roots`` through ``linear`` while the block runs.

    The modules are patched per instance (no Python in the other ops of the forward) and restored
    on exit; a module another ``skinny_linears`` already patched is left to that one, and so are the
    modules in ``skip`` (linears a ``fastpath.FastPath`` replaced by fused copies: not packed twice).
    Their fp32 CPU weights are packed for the kernel here, once per weight (not in the middle of a
    timed step).
    """
    patched = []
    skip = {id(m) for m in skip}
    token = _max_rows.set(max_rows)
    pin = _pinned.set(_in_use() if max_rows > 0 else None)  # $SPECDEC_KERNEL once, not per call
    if max_rows > 0:
        calibrate()  # once per process, before any timed step
        for root in roots:
            for m in root.modules():
                if type(m) is nn.Linear and "forward" not in m.__dict__ and id(m) not in skip:
                    m.forward = partial(_forward, m, max_rows)
                    patched.append(m)
                    prepack([m.weight], max_rows)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
        _max_rows.reset(token)
        _pinned.reset(pin)


def max_rows() -> int:
    """The max_rows of the innermost ``skinny_linears`` block running (0 outside any: torch's linears):
    what a direct caller of ``linear`` that follows the block (``fastpath``) passes on."""
    return _max_rows.get()
