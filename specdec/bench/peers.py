"""Other engines beside specdec in `specdec bench --peer NAME`: each runs in its own process, on the
GGUF file the bench's target came from and on exactly the bench's prompt token ids, once before
specdec's timed block and once after it; its rows join the bench's table and summary.

    setup = peer_setup("llama.cpp", python, "default", ...)   # bad input named before any timing
    session = PeerSession(setup, request)
    session.run("before"); <the bench>; session.run("after")
    records = session.records(question_ids, categories, hf_answers)   # the bench's record format

A peer is a script run by path with the peer's own interpreter (``--peer-python``), exchanging JSON
files (REQUEST in, RESULT out, each written atomically): see ``specdec.bench.peer_llamacpp``. When
that interpreter lacks the peer's package, the peer's rows are skipped with one message saying how
to install it, and the bench runs on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench import peer_llamacpp
from specdec.bench.peer_llamacpp import write_json
from specdec.models import default_gguf_path

# runs a script by path without putting its folder on sys.path (no module beside it shadows one the
# peer imports); run from the exchange folder, so the current directory holds only its JSON files
LAUNCH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


@dataclass(frozen=True)
class Peer:
    name: str  # as --peer spells it
    script: Path  # run as: PYTHON -c LAUNCH SCRIPT REQUEST.json RESULT.json
    module: str  # what the script imports from the peer's interpreter
    package: str  # that module's distribution, as pip names it
    install: str  # how to get it, said when it is missing
    labels: dict = field(default_factory=dict)  # RESULT's mode -> the row's name


LLAMA_CPP = Peer(
    name="llama.cpp", script=Path(peer_llamacpp.__file__), module="llama_cpp", package="llama-cpp-python",
    install=("install it into that interpreter with `pip install llama-cpp-python` (or specdec's extra "
             "`pip install 'specdec[peers]'`); pip builds llama.cpp from source for several minutes. Set "
             "CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" for that build: a native build segfaulted on an AMX Xeon "
             "evaluating a Q4_1 prompt"),
    labels={"plain": "llama.cpp plain", "lookup": "llama.cpp + prompt lookup"})
PEERS = {p.name: p for p in (LLAMA_CPP,)}


class PeerUnavailable(Exception):
    """The peer gave no results: the message says why (and, for a missing package, how to get it)."""


@dataclass(frozen=True)
class PeerSetup:
    peer: Peer
    python: Path  # the interpreter that runs the peer's script
    gguf: Path  # the file the bench's target came from


def peer_setup(name: str, python: str | None, model: str, temperature: float = 0.0, repeat: int = 1,
               batch_size=None) -> PeerSetup:
    """``--peer NAME`` checked against the rest of the command line: a known peer, an interpreter that
    exists, a GGUF target, one greedy pass at batch 1 (what the comparison is made of)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: known peers are {', '.join(PEERS)}")
    if temperature:
        raise ValueError("--peer compares greedy outputs: it cannot run with --temperature > 0")
    if repeat > 1 or batch_size:
        raise ValueError("--peer runs one pass at batch 1: it cannot run with --repeat or --batch-size")
    exe = Path(python or sys.executable).expanduser()
    if not exe.is_file():
        raise ValueError(f"--peer-python {exe} does not exist")
    if not os.access(exe, os.X_OK):
        raise ValueError(f"--peer-python {exe} is not executable")
    if model == "default":
        gguf = default_gguf_path()
    else:
        gguf = Path(model).expanduser()
        if not (gguf.is_file() and gguf.suffix == ".gguf"):
            raise ValueError(f"--peer {name} runs on a GGUF file, and --model {model!r} is not one "
                             "(use 'default' or a .gguf file)")
    return PeerSetup(PEERS[name], exe, gguf)


def call_peer(setup: PeerSetup, request: dict) -> dict:
    """The peer's RESULT for ``request`` (its process started and ended here); PeerUnavailable when
    the peer's package is missing or its process ended without a result."""
    peer = setup.peer
    with tempfile.TemporaryDirectory(prefix="specdec-peer-") as d:
        req, res = Path(d) / "request.json", Path(d) / "result.json"
        write_json(req, {**request, "gguf": str(setup.gguf)})
        done = subprocess.run([str(setup.python), "-c", LAUNCH, str(peer.script), str(req), str(res)], cwd=d,
                              capture_output=True, text=True)
        if not res.exists():
            raise PeerUnavailable(f"{peer.name} rows skipped: {_ended(done)}")
        result = json.loads(res.read_text(encoding="utf-8"))
    if "missing" in result:
        raise PeerUnavailable(f"{peer.name} rows skipped: {setup.python} cannot import {peer.module} "
                              f"({result['missing']}); {peer.install}")
    return result


def _ended(done: subprocess.CompletedProcess) -> str:
    """How a peer's process ended without a result, with the last line it wrote to stderr."""
    rc = done.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    last = (done.stderr or "").strip().splitlines()[-1:] or ["(nothing on stderr)"]
    hint = (" (a native llama.cpp build can segfault: rebuild it with CMAKE_ARGS=\"-DGGML_NATIVE=OFF\")"
            if rc == -signal.SIGSEGV else "")
    return f"its process ended ({how}) before writing results: {last[0]}{hint}"


class PeerSession:
    """One peer's runs around specdec's timed block. ``request``: prompts ([[id, ...]] in question
    order), eos, max_new_tokens, threads, lookup_tokens (peer_llamacpp's REQUEST without the file).
    After the first run that gives no results, ``skipped`` holds why and later runs do nothing."""

    def __init__(self, setup: PeerSetup, request: dict, say=print) -> None:
        self.setup, self.request, self.say = setup, request, say
        self.results: dict[str, dict] = {}  # "before" / "after" -> RESULT
        self.skipped: str | None = None

    def run(self, when: str) -> None:
        if self.skipped is not None:
            return
        try:
            self.results[when] = call_peer(self.setup, self.request)
        except PeerUnavailable as e:
            self.skipped = str(e)
            self.say(self.skipped)
            return
        self.say(f"{self.setup.peer.name} ran {when} specdec's timed block: {self.setup.peer.package} "
                 f"{self.results[when]['version']}, in its own process ({self.setup.python})")

    def records(self, question_ids: list, categories: list[str], answers: dict) -> list[dict]:
        """The bench's records (pass 1) for every run, mode and question: ``answers`` maps a question
        id to HF generate's new tokens of this run; identical = the peer's reply equals it."""
        out = []
        for mode, label in self.setup.peer.labels.items():  # rows: plain (before), plain (after), ...
            for when, result in self.results.items():
                runs = result["modes"][mode]
                for qid, category, r in zip(question_ids, categories, runs, strict=True):
                    out.append({"pass": 1, "question_id": qid, "category": category,
                                "method": f"{label} ({when})",
                                "new_tokens": len(r["ids"]), "seconds": r["seconds"], "steps": None,
                                "identical": r["ids"] == answers[qid]})
        return out

    def meta(self) -> dict:
        """For the summary: which peer, which version, how it ran (or why it did not)."""
        versions = sorted({r["version"] for r in self.results.values()})
        return {"name": self.setup.peer.name, "package": self.setup.peer.package, "version": ", ".join(versions),
                "process": "its own, before and after specdec's timed block", "python": str(self.setup.python),
                "gguf": str(self.setup.gguf), "runs": list(self.results), "skipped": self.skipped,
                **{k: v for k, v in self.request.items() if k != "prompts"}}

    def note(self) -> str:
        """One line under the bench's table saying what the peer's rows are."""
        if not self.results:
            return self.skipped or f"{self.setup.peer.name} did not run"
        m = self.meta()
        said = (f"{m['name']} rows: {m['package']} {m['version']}, in its own process {' and '.join(m['runs'])} "
                f"specdec's timed block, on {m['gguf']} with {m['threads']} threads and the same prompt ids; "
                "identical = equal to hf-generate's greedy output of this run")
        return said if self.skipped is None else f"{said}. {self.skipped}"
