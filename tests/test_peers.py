"""`specdec bench --peer`: the harness around another engine, tested with a fake `llama_cpp` package
on the peer process's path (a Llama whose greedy reply is fixed), so no llama.cpp is needed. What is
pinned: the exchange with the peer's own process, the comparison with HF's answers, the skip when the
package is missing, and bad input named before any model loads."""

import json
import sys

import pytest

from specdec.bench.peers import LLAMA_CPP, PeerSession, PeerSetup, peer_setup

FAKE_LLAMA = '''
import json
from pathlib import Path

__version__ = "0.0-fake"


class Llama:
    """Replies to a prompt ending in t with t+1, t+2, 2 (EOS), 9, 9, ...; notes how it was built."""

    def __init__(self, model_path, **kw):
        draft = kw.pop("draft_model")
        seen = Path(model_path).with_suffix(".seen.jsonl")
        with open(seen, "a") as f:
            f.write(json.dumps({**kw, "draft": None if draft is None else draft.num_pred_tokens}) + "\\n")

    def reset(self):
        pass

    def generate(self, tokens, **kw):
        assert kw["top_k"] == 1 and kw["temp"] == 0.0 and kw["repeat_penalty"] == 1.0
        yield from [tokens[-1] + 1, tokens[-1] + 2, 2]
        while True:
            yield 9
'''
FAKE_LOOKUP = '''
class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens):
        self.num_pred_tokens = num_pred_tokens
'''


def _fake_package(root, init: str, lookup: str = FAKE_LOOKUP):
    pkg = root / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "llama_speculative.py").write_text(lookup)
    return root


@pytest.fixture
def gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")  # the fake never reads it
    return f


def _session(monkeypatch, fake_root, gguf, max_new_tokens=8):
    monkeypatch.setenv("PYTHONPATH", str(fake_root))  # the peer's process finds the fake first
    said = []
    request = {"prompts": [[1, 5], [1, 7]], "eos": [2], "max_new_tokens": max_new_tokens, "threads": 2,
               "lookup_tokens": 10}
    session = PeerSession(PeerSetup(LLAMA_CPP, sys.executable, gguf), request, said.append)
    return session, said


def test_the_peers_replies_are_read_back_and_compared_with_hf(tmp_path, gguf, monkeypatch):
    session, said = _session(monkeypatch, _fake_package(tmp_path / "fake", FAKE_LLAMA), gguf)
    session.run("before")
    session.run("after")
    # the fake's replies: [6, 7, 2] and [8, 9, 2]; HF's answer to q2 differs in its last token
    records = session.records(["q1", "q2"], ["coding", "math"], {"q1": [6, 7, 2], "q2": [8, 9, 3]})
    by = {}
    for r in records:
        by.setdefault(r["method"], []).append(r)
    assert list(by) == ["llama.cpp plain (before)", "llama.cpp plain (after)",
                        "llama.cpp + prompt lookup (before)", "llama.cpp + prompt lookup (after)"]
    for rs in by.values():
        assert [(r["question_id"], r["new_tokens"], r["identical"]) for r in rs] == [("q1", 3, True), ("q2", 3, False)]
        assert all(r["seconds"] >= 0 and r["steps"] is None and r["pass"] == 1 for r in rs)
    built = [json.loads(line) for line in gguf.with_suffix(".seen.jsonl").read_text().splitlines()]
    assert [b["draft"] for b in built] == [None, 10, None, 10]  # plain, lookup; before, after
    assert all(b["n_threads"] == 2 and b["n_threads_batch"] == 2 for b in built)
    assert session.meta()["version"] == "0.0-fake" and session.meta()["runs"] == ["before", "after"]
    assert "0.0-fake" in said[0] and "own process" in said[0] and "before" in said[0]
    assert "before and after" in session.note()


def test_a_reply_stops_at_the_token_budget(tmp_path, gguf, monkeypatch):
    session, _ = _session(monkeypatch, _fake_package(tmp_path / "fake", FAKE_LLAMA), gguf, max_new_tokens=2)
    session.run("before")
    records = session.records(["q1", "q2"], ["coding", "math"], {"q1": [6, 7], "q2": [8, 9, 2]})
    plain = [r for r in records if r["method"] == "llama.cpp plain (before)"]
    assert [(r["new_tokens"], r["identical"]) for r in plain] == [(2, True), (2, False)]


def test_a_missing_llama_cpp_skips_the_rows_with_how_to_install_it(tmp_path, gguf, monkeypatch):
    missing = "raise ModuleNotFoundError(\"No module named 'llama_cpp'\", name='llama_cpp')\n"
    session, said = _session(monkeypatch, _fake_package(tmp_path / "fake", missing), gguf)
    session.run("before")
    session.run("after")
    assert session.records(["q1", "q2"], ["coding", "math"], {}) == []
    assert len(said) == 1 and said[0] == session.skipped == session.note()
    for part in ("llama.cpp rows skipped", "cannot import llama_cpp", "pip install llama-cpp-python",
                 "GGML_NATIVE=OFF"):
        assert part in said[0]


def test_a_crashing_peer_is_named_and_skipped(tmp_path, gguf, monkeypatch):
    crash = "import sys\nsys.stderr.write('boom\\n')\nsys.exit(3)\n"
    session, said = _session(monkeypatch, _fake_package(tmp_path / "fake", crash), gguf)
    session.run("before")
    assert said == ["llama.cpp rows skipped: its process ended (exit status 3) before writing results: boom"]


def test_a_peer_that_fails_after_keeps_its_rows_from_before(tmp_path, gguf, monkeypatch):
    session, said = _session(monkeypatch, _fake_package(tmp_path / "fake", FAKE_LLAMA), gguf)
    session.run("before")
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text("import sys\nsys.exit(3)\n")
    session.run("after")
    records = session.records(["q1", "q2"], ["coding", "math"], {"q1": [6, 7, 2], "q2": [8, 9, 3]})
    assert {r["method"] for r in records} == {"llama.cpp plain (before)", "llama.cpp + prompt lookup (before)"}
    assert "in its own process before specdec's" in session.note() and session.note().endswith(said[-1])


@pytest.mark.parametrize("argv, message", [
    (["--peer", "vllm"], "unknown peer 'vllm': known peers are llama.cpp"),
    (["--peer", "llama.cpp", "--peer-python", "/no/such/python"], "--peer-python /no/such/python does not exist"),
    (["--peer", "llama.cpp", "--model", "{tmp}"], "--peer llama.cpp runs on a GGUF file, and --model '{tmp}' is not one"),
    (["--peer", "llama.cpp", "--temperature", "0.7"], "--peer compares greedy outputs"),
    (["--peer", "llama.cpp", "--batch-size", "2"], "--peer runs one pass at batch 1"),
])
def test_bad_peer_input_is_named_before_any_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.setattr("specdec.models.load_model", lambda *a, **k: pytest.fail("model loaded first"))
    monkeypatch.setattr("specdec.bench.peers.default_gguf_path", lambda: tmp_path)  # no package needed
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdec bench: error: {message.replace('{tmp}', str(tmp_path))}")
    assert err.count("\n") == 1


def test_the_peer_runs_on_the_targets_gguf_with_this_interpreter_by_default(gguf, monkeypatch):
    monkeypatch.setattr("specdec.bench.peers.default_gguf_path", lambda: gguf)
    assert peer_setup("llama.cpp", None, "default").gguf == gguf
    setup = peer_setup("llama.cpp", None, str(gguf))
    assert (setup.gguf, str(setup.python)) == (gguf, sys.executable)
