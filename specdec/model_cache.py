"""A converted model's cache folder: config, generation config, tokenizer, ``model.safetensors`` and a
manifest with the weights' size and SHA-256, written aside and renamed into place, checked before every
use (a corrupt or truncated folder is rebuilt, never used) and built by one process at a time. Where the
folders live is the runtime configuration's ``cache_dir``. ``specdec.models`` fills and reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from specdec.config import current as current_runtime

CACHE_FORMAT = 2  # bump when the cached layout changes (2: configs fixed per architecture, rope divisors)


def cache_root() -> Path:
    """Where converted models live: the runtime configuration's ``cache_dir`` (``specdec.config``)."""
    return current_runtime().cache_dir


def sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_folder(gguf: Path, dtype: torch.dtype, kind: str = "fp32") -> Path:
    """kind: "fp32" (the whole model dequantized) or "packed" (config, tokenizer, float tensors only)."""
    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}|{dtype}|{CACHE_FORMAT}"
    suffix = "" if kind == "fp32" else f"-{kind}"
    return cache_root() / "gguf" / f"{gguf.stem}{suffix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


VERIFIED = "verified.json"  # a cache folder's record of its weights' stat when they last hashed right
SETTLED_S = 2.0  # weights changed more recently than this are hashed at every load (see is_valid)


def is_valid(d: Path) -> bool:
    """The folder's manifest is this format's and its weights have the manifest's size and SHA-256.

    The hash (~0.8 s for the default model's fp32 weights) runs once per change of the weights: when it
    matches, the file's stat (size, mtime, ctime, inode) is recorded beside it, and a later load whose stat
    is the same takes the file as hashed. Any write moves ctime, which no user call can set back; a file
    changed within SETTLED_S of now is hashed every time, as a second write within one timestamp tick
    would leave its stat unchanged (git's rule for "racily clean" files)."""
    try:
        manifest = json.loads((d / "manifest.json").read_text())
        weights = d / "model.safetensors"
        st = weights.stat()
        if manifest.get("format") != CACHE_FORMAT or st.st_size != manifest["size"]:
            return False
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, manifest["sha256"]]
        try:
            if json.loads((d / VERIFIED).read_text()) == stamp:
                return True
        except (OSError, ValueError):
            pass
        if sha256(weights) != manifest["sha256"]:
            return False
        if time.time() - max(st.st_mtime, st.st_ctime) > SETTLED_S:
            write_atomic(d / VERIFIED, json.dumps(stamp))
        return True
    except (OSError, ValueError, KeyError):
        return False


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` by a temporary file renamed over it; a folder that cannot be written is passed
    over (the record only saves time)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def ensure(d: Path, build) -> None:
    """Run ``build()`` to make cache folder ``d`` unless it is valid. One process builds at a time (a
    lock file beside the folder): a second one waits, then finds it valid, so two processes starting
    at once never replace the folder under each other's load."""
    from filelock import FileLock

    if is_valid(d):
        return
    d.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(d.parent / f".{d.name}.lock")):
        if not is_valid(d):
            build()


def write(dest: Path, gguf: Path, config, generation_config, tokenizer, save_weights, save_extra=None) -> None:
    """A cache folder at ``dest``: config, generation config, tokenizer, ``model.safetensors`` (written
    by ``save_weights(path)``), whatever ``save_extra(folder)`` adds, and a manifest with the weights'
    SHA-256, built aside and renamed into place."""
    # save_pretrained refuses a GGUF-loaded model; a plain config + safetensors of the same weights
    # reloads as the same model (the quantization entry only describes the source file).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
    try:
        config.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        weights = tmp / "model.safetensors"
        save_weights(weights)
        if save_extra is not None:
            save_extra(tmp)
        manifest = {"format": CACHE_FORMAT, "source": str(gguf), "size": weights.stat().st_size,
                    "sha256": sha256(weights)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
