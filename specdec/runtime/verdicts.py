"""The self-checks' timed verdicts, kept on disk per machine and build so that a new process does not time
again what an earlier one timed (the fp32 routes: ~3-4 s of every command's start-up).

A verdict (``calibrate``'s routes, ``qlinear``'s routes of a block format, ``int8_linear``'s draft route) is a
small JSON record under ``cache_dir``/selfcheck/, named by the digest of its key:

- the machine: the CPU's model name and feature flags (``/proc/cpuinfo``; elsewhere the platform's
  processor string), its architecture, and torch's thread count (the routes' timings depend on it);
- the build: the compiled kernels' build key (``build.build_id``: sources, checkout, torch version,
  flags) and torch's version;
- what the check ran under: the kernel variant, huge pages, and the check's own parameters (sizes, rounds).

It is written atomically (a temporary file in the same folder, renamed over the old one) and read back
only if the record is whole: its format, its key equal to the one asked for field by field (a digest
collision or a copied folder reads as a miss), and a SHA-256 of the verdict. A miss, a torn record or a
verdict of the wrong shape is timed again and rewritten, never used. A record that reads back whole is
still not trusted blindly: the caller runs a cheap spot check of every kernel route it names against the
reference (``calibrate.spot_check``, ``qlinear.correctness``) before using it, and times again if one fails.
Delete the folder (or run with ``RuntimeConfig(calibration_cache=False)``, ``SPECDEC_CALIBRATION_CACHE=off``)
to time everything again, e.g. after moving a busy machine's verdicts to a quiet one. Why:
docs/decisions/023-start-up.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from functools import cache
from pathlib import Path

import torch

from specdec.config import RuntimeConfig
from specdec.runtime.build import build_id

FORMAT = 1  # bump when a record's layout or a verdict's meaning changes
log = logging.getLogger(__name__)


@cache
def _cpu() -> tuple[str, str]:
    """(model name, sorted feature flags) of this machine's first CPU, read once a process."""
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if field == "model name" and not name:
                    name = value.strip()
                elif field in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                elif not line.strip() and (name or flags):  # the first processor's block ends here
                    break
    except OSError:  # not Linux: the platform's string only
        pass
    return name or platform.processor(), flags


def key(config: RuntimeConfig, kind: str, params: dict) -> dict | None:
    """What a verdict of ``kind`` timed under ``config`` with ``params`` depends on; None where nothing can
    be kept (no build loaded for the variant: the routes then take torch's paths, nothing to time)."""
    build = build_id(config)
    if build is None:
        return None
    name, flags = _cpu()
    return {"format": FORMAT, "kind": kind, "cpu": name, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "build": build, "variant": config.variant, "hugepages": config.hugepages, "params": params}


def folder(config: RuntimeConfig) -> Path:
    """Where the verdicts live: ``cache_dir``/selfcheck."""
    return Path(config.cache_dir) / "selfcheck"


def _path(config: RuntimeConfig, k: dict) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20]
    return folder(config) / f"{k['kind']}-{digest}.json"


def _checksum(verdict) -> str:
    return hashlib.sha256(json.dumps(verdict, sort_keys=True).encode()).hexdigest()


def load(config: RuntimeConfig, kind: str, params: dict):
    """The stored verdict of ``kind`` for this machine, build, configuration and ``params``, or None (off,
    none stored, or a record that is not whole: it is left to be overwritten). Not yet spot-checked."""
    k = key(config, kind, params) if config.calibration_cache else None
    if k is None:
        return None
    path = _path(config, k)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("specdec: the stored self-check %s is unreadable (%s); timing it again", path, e)
        return None
    if (not isinstance(record, dict) or record.get("key") != k or "verdict" not in record
            or record.get("sha256") != _checksum(record["verdict"])):
        log.warning("specdec: the stored self-check %s is torn or not this machine's; timing it again", path)
        return None
    return record["verdict"]


def store(config: RuntimeConfig, kind: str, params: dict, verdict) -> None:
    """Keep ``verdict`` (JSON-able) for later processes; a folder that cannot be written is passed over
    with a warning (the verdict still holds for this process)."""
    k = key(config, kind, params) if config.calibration_cache else None
    if k is None:
        return
    path = _path(config, k)
    record = {"key": k, "verdict": verdict, "sha256": _checksum(verdict)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
                f.flush()
                os.fsync(f.fileno())  # whole on disk before it takes the name
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        log.warning("specdec: could not keep the self-check's verdict in %s (%s)", path.parent, e)
