"""The runtime configuration, and the one place the process environment is read.

Library code takes a ``RuntimeConfig`` as a parameter (``SpecDecoderConfig.runtime``) or runs inside a
``specdec.runtime.use(config)`` block; it never reads ``os.environ``. The edge reads it once:
the CLI (``specdec.cli.main``) calls ``RuntimeConfig.from_environ()``, and so can a Python entry:

    from specdec.config import RuntimeConfig
    from specdec.decoder import SpecDecoder, SpecDecoderConfig

    decoder = SpecDecoder(target, drafter, SpecDecoderConfig(runtime=RuntimeConfig.from_environ()))

The variables (unset or empty: the default):

    SPECDEC_KERNEL            native | avx2 | off      the CPU kernel variant
    SPECDEC_KERNEL_CALIBRATE  1 | 0 (on | off)         the per-process route self-check
    SPECDEC_CALIBRATION_CACHE on | off                 the self-checks' timed verdicts kept on disk
    SPECDEC_ATTENTION         auto | sdpa              the attention kernel where it wins, or SDPA always
    SPECDEC_FUSED             on | off                 the lean forward's fused layer ops
    SPECDEC_ONE_CALL          on | off                 all layers of a forward in one compiled call
    SPECDEC_FASTPATH          on | off                 the lean forward for Llama-shaped targets
    SPECDEC_HUGEPAGES         on | off                 packed weights on transparent huge pages
    SPECDEC_CACHE             a directory              converted models, kernel builds (else
                                                       $XDG_CACHE_HOME/specdec, else ~/.cache/specdec)
    SPECDEC_EAGLE_HEAD        a directory              the EAGLE head (else the packaged one)
    SPECDEC_BENCH_THREADS     an integer >= 1          torch threads of a benchmark's child process
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

KERNELS = ("native", "avx2", "off")
ATTENTIONS = ("auto", "sdpa")
_SWITCH = {"on": True, "off": False}
_CALIBRATE = {"1": True, "0": False, "on": True, "off": False}


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec (``env``: a mapping of
    variables; None: none set)."""
    env = env or {}
    if env.get("SPECDEC_CACHE"):
        return Path(env["SPECDEC_CACHE"])
    return Path(env.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "specdec"


@dataclass(frozen=True)
class RuntimeConfig:
    # the CPU kernels' build: "native" (this CPU's widest vectors: 16-float panels on AVX-512), "avx2"
    # (the 8-float shape, -march=x86-64-v3, even on an AVX-512 CPU: to measure it), "off" (torch's paths)
    kernel: str = "native"
    # time each linear route per block size and the attention kernel against SDPA once per process and
    # keep the fastest (docs/decisions/002-linear-routes.md, 003-attention-kernel.md); off: 1-4 rows
    # W @ x^T, 5-16 the packed kernel, the attention kernel wherever it takes the call
    calibrate: bool = True
    # keep the self-checks' timed verdicts on disk (``cache_dir``/selfcheck, per machine, kernel build,
    # torch and thread count) and reuse them in later processes after a spot check of every kernel route
    # they name (``specdec.runtime.verdicts``): ~3-4 s less start-up; off: every process times them again
    calibration_cache: bool = True
    # "auto": the attention kernel where the self-check found it faster than SDPA; "sdpa": SDPA always
    attention: str = "auto"
    # the lean forward's fused layer ops (norm + residual, q/k/v split + rotary, SiLU x up) for fp32 on
    # CPU; off: HF's ops one by one (docs/decisions/004-lean-forward.md)
    fused: bool = True
    # every layer of a forward in one compiled call where the store hands over its buffers (a BMC
    # store); off: the layer loop in Python (same results bit for bit)
    one_call: bool = True
    # the lean forward for Llama-shaped targets; off: HF's forward (to compare, or to rule it out)
    fastpath: bool = True
    # the packed weights on transparent huge pages (2 MB, Linux); off: ordinary pages
    hugepages: bool = True
    # converted models and the kernels' builds live under here
    cache_dir: Path = field(default_factory=default_cache_dir)
    # the EAGLE head a bare "eagle" drafter loads; None: the head packaged for the default model
    eagle_head: Path | None = None
    # the EAGLE-3 head (a vLLM / SGLang / speculators directory) an "eagle3" drafter loads; None: none
    eagle3_head: Path | None = None
    # torch threads of a benchmark's child process (bench-longctx's peak-memory runs)
    bench_threads: int = 2

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: expected one of {', '.join(KERNELS)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: expected one of {', '.join(ATTENTIONS)}")
        if self.bench_threads < 1:
            raise ValueError(f"bench_threads={self.bench_threads}: expected at least 1")

    @property
    def variant(self) -> str | None:
        """The kernel variant to build (a key of ``specdec.runtime.build.VARIANTS``), None when off."""
        return None if self.kernel == "off" else self.kernel

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> RuntimeConfig:
        """The configuration the SPECDEC_* variables of ``env`` (default: this process's) describe; a
        ValueError names a variable with a value it does not take."""
        env = os.environ if env is None else env

        def pick(name: str, choices: Mapping, default):
            value = env.get(name, "")
            if value == "":
                return default
            if value not in choices:
                raise ValueError(f"{name}={value!r}: expected {' or '.join(choices)}")
            return choices[value]

        threads = env.get("SPECDEC_BENCH_THREADS", "") or "2"
        if not threads.isdigit() or int(threads) < 1:
            raise ValueError(f"SPECDEC_BENCH_THREADS={threads!r}: expected a whole number of threads >= 1")
        head, head3 = env.get("SPECDEC_EAGLE_HEAD", ""), env.get("SPECDEC_EAGLE3_HEAD", "")
        return cls(kernel=pick("SPECDEC_KERNEL", {k: k for k in KERNELS}, "native"),
                   calibrate=pick("SPECDEC_KERNEL_CALIBRATE", _CALIBRATE, True),
                   calibration_cache=pick("SPECDEC_CALIBRATION_CACHE", _SWITCH, True),
                   attention=pick("SPECDEC_ATTENTION", {a: a for a in ATTENTIONS}, "auto"),
                   fused=pick("SPECDEC_FUSED", _SWITCH, True),
                   one_call=pick("SPECDEC_ONE_CALL", _SWITCH, True),
                   fastpath=pick("SPECDEC_FASTPATH", _SWITCH, True),
                   hugepages=pick("SPECDEC_HUGEPAGES", _SWITCH, True),
                   cache_dir=default_cache_dir(env),
                   eagle_head=Path(head).expanduser() if head else None,
                   eagle3_head=Path(head3).expanduser() if head3 else None,
                   bench_threads=int(threads))


def hub_offline() -> None:
    """Keep huggingface_hub off the network for this process unless the user said otherwise (the
    CLI's edge: models load from files on disk)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@contextmanager
def tools_on_path(directory: str) -> Iterator[None]:
    """``directory`` first on $PATH while the block runs, restored after.

    torch's extension builder starts ``ninja`` by name from $PATH and takes no other way to find it; the
    pip-installed ninja of a virtual environment that was not activated is not on it. Scoped here, the
    one module that touches the environment, for the length of a build.
    """
    saved = os.environ.get("PATH")
    os.environ["PATH"] = directory + os.pathsep + (saved or "")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


_scope: ContextVar[RuntimeConfig | None] = ContextVar("specdec_runtime_config", default=None)
_DEFAULT = RuntimeConfig()


def current() -> RuntimeConfig:
    """The configuration of the innermost ``use`` block running, else the defaults."""
    config = _scope.get()
    return _DEFAULT if config is None else config


@contextmanager
def use(config: RuntimeConfig) -> Iterator[RuntimeConfig]:
    """Run the block under ``config``: what library code takes where no caller passed one (a decoder
    built with ``SpecDecoderConfig(runtime=None)``, a model load, a direct call of the kernels). The CLI
    runs each command inside one, made from the environment."""
    token = _scope.set(config)
    try:
        yield config
    finally:
        _scope.reset(token)
