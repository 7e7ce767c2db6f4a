"""Building (or loading the cached build of) the CPU kernels in ``csrc/``, per variant.

A variant is a set of compiler flags and the op namespace its build registers under: "native" is what
this CPU supports (16-float panels on AVX-512, 8-float ones elsewhere); "avx2" forces the 8-float shape
on any x86-64-v3 CPU, AVX-512 ones included, so both can load in one process. Builds are keyed by the
sources, torch's version and the flags, and cached under the runtime's ``cache_dir``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
from functools import cache
from pathlib import Path

import torch

from specdec.config import RuntimeConfig, current, tools_on_path

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / f for f in (
    "packed_linear.cpp", "decode_attention.cpp", "layer_ops.cpp", "layers.cpp", "quant_linear.cpp",
    "int8_linear.cpp", "row_attention.cpp", "prompt_attention.cpp")]
_HEADERS = [_CSRC / f for f in ("vec.h", "ops.h")]  # in the build key, not compiled alone
# variant -> (compiler flags, op namespace)
VARIANTS = {"native": (["-march=native"], "specdec_kernels"),
            "avx2": (["-march=x86-64-v3"], "specdec_kernels_avx2")}
# at::parallel_for is inlined into the kernel: without OpenMP it runs every strip on the calling thread
# (one core streaming the weights; docs/decisions/002-linear-routes.md). The loader resolves
# libgomp.so.1 to the copy torch already loaded, so the kernel shares torch's pool.
_OPENMP = ["-fopenmp"]
log = logging.getLogger(__name__)
# variant -> the key of the build this process loaded for it (sources, checkout, torch, flags): what the
# self-checks' stored verdicts are tied to (``specdec.runtime.verdicts``)
_LOADED: dict[str, str] = {}


def extension(config: RuntimeConfig | None = None):
    """The compiled ops of ``config``'s variant (default: the configuration in force), built on first
    use; None if it is off or cannot be built."""
    config = current() if config is None else config
    return None if config.variant is None else build(config.variant, config.cache_dir)


@cache
def build(name: str, cache_dir: Path):
    """Build (or load the cached build of) a variant: with OpenMP, else (a compiler without it) on one
    thread, which the route self-check then weighs like any other route; None if neither builds."""
    try:
        if shutil.which("ninja") is None:  # pip's ninja is not on PATH in a venv that is not activated
            import ninja

            with tools_on_path(ninja.BIN_DIR):
                return _with_or_without_openmp(name, cache_dir)
        return _with_or_without_openmp(name, cache_dir)
    except Exception as e:  # no compiler, no ninja, an unknown -march: torch's path still works
        log.warning("specdec: the packed linear kernel could not be built (%s); the few-row blocks "
                    "take torch's paths", first_line(e))
        return None


def _with_or_without_openmp(name: str, cache_dir: Path):
    try:
        return _load(name, _OPENMP, cache_dir)
    except Exception as e:  # noqa: BLE001
        log.warning("specdec: the packed linear kernel did not build with OpenMP (%s); building it "
                    "for one thread", first_line(e))
        return _load(name, [], cache_dir)


def build_other(csrc: Path, variant: str, namespace: str, cache_dir: Path):
    """Another checkout's kernel sources (``csrc``, with this checkout's file names) built with ``variant``'s
    flags under the op namespace ``namespace``, beside this checkout's builds: two builds timed in one process
    (``scripts/kernel_ceilings.py --against``)."""
    sources = [csrc / f.name for f in _SOURCES]
    missing = [str(f) for f in sources if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{csrc} lacks {', '.join(missing)}")
    flags, _ = VARIANTS[variant]
    directory = cache_dir / "torch_extensions" / f"{namespace}-{variant}"
    directory.mkdir(parents=True, exist_ok=True)
    _compile(f"{namespace}_{variant}", sources, directory, flags, _OPENMP, namespace)
    return getattr(torch.ops, namespace)


def _compile(name: str, sources: list[Path], directory: Path, flags: list[str], openmp: list[str], namespace: str):
    """torch's extension builder over ``sources`` into ``directory``, registering the ops under ``namespace``:
    the one set of compiler options every build of the kernels takes (this checkout's and ``build_other``'s)."""
    from torch.utils.cpp_extension import load

    load(name=name, sources=[str(f) for f in sources], build_directory=str(directory),
         extra_cflags=["-O3", *flags, *openmp, f"-DSPECDEC_OPS={namespace}"], extra_ldflags=openmp,
         is_python_module=False, verbose=False)


def build_id(config: RuntimeConfig | None = None) -> str | None:
    """The key of the build of ``config``'s variant (default: the configuration in force) that this process
    loaded, or None (off, not built, or not loaded yet)."""
    config = current() if config is None else config
    return None if config.variant is None else _LOADED.get(config.variant)


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _load(name: str, openmp: list[str], cache_dir: Path):
    flags, ns = VARIANTS[name]
    sources = b"".join(f.read_bytes() for f in _SOURCES + _HEADERS)
    # the checkout's path too: the build's ninja file names the sources by absolute path, so two checkouts
    # sharing one build directory would rebuild it in turn
    key = hashlib.sha256(sources + str(_CSRC.resolve()).encode() + torch.__version__.encode()
                         + " ".join([name, *flags, *openmp]).encode()).hexdigest()[:16]
    directory = cache_dir / "torch_extensions" / f"packed_linear-{key}"
    library = directory / f"specdec_packed_linear_{key}.so"
    if library.is_file() and not (directory / "lock").exists():
        # built before from exactly these sources, flags and torch (the key names them all), and no build is
        # running (torch's builder holds ``lock`` meanwhile): loaded as it is, without importing torch's
        # extension builder (setuptools with it) and running ninja to find nothing to do: ~0.3 s a process
        torch.ops.load_library(str(library))
    else:
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob("*.so")):  # say it once: the build takes ~20 s and is not generation time
            print(f"specdec: building the CPU kernel ({name}, once, ~20 s) ...", file=sys.stderr, flush=True)
        _compile(library.stem, _SOURCES, directory, flags, openmp, ns)
    _LOADED[name] = key
    return getattr(torch.ops, ns)
