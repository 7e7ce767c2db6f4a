"""`specdec perplexity --peer-python`: llama.cpp's perplexity on the same ids, through its own process,
tested with a fake `llama_cpp` whose logits are a fixed distribution (p(k) = (k + 1) / 15 over 5 tokens),
so the expected perplexity is known in closed form; and bad input named before any model loads."""

import math
import sys

import pytest

from specdec.bench.peers import LLAMA_CPP, PeerSetup, PeerUnavailable
from specdec.bench.perplexity import peer_perplexity
from specdec.cli import main

FAKE = '''
import numpy as np

__version__ = "0.0-fake"


class Llama:
    def __init__(self, model_path, **kw):
        assert kw["logits_all"] and kw["n_ctx"] >= 3
        self.scores = np.full((kw["n_ctx"], 5), np.nan, dtype=np.float32)

    def reset(self):
        self.scores[:] = np.nan

    def eval(self, ids):
        self.scores[: len(ids)] = np.log(np.arange(1, 6)) + 7.0  # any shift: softmax ignores it
'''


@pytest.fixture
def setup(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))  # the peer's process finds the fake first
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # the fake never reads it
    return PeerSetup(LLAMA_CPP, sys.executable, gguf)


def test_the_peers_perplexity_is_its_mean_nll_over_every_next_token(setup):
    texts = [[0, 1, 4], [2, 3]]
    row = peer_perplexity(setup, texts, threads=1)
    nexts = [1, 4, 3]  # every position but the last predicts the next token
    expected = math.exp(-sum(math.log((t + 1) / 15) for t in nexts) / len(nexts))
    assert row["tokens"] == 3 and row["books"] == 2 and row["version"] == "0.0-fake"
    assert row["perplexity"] == pytest.approx(expected, rel=1e-6)  # the logits are float32


def test_a_peer_without_llama_cpp_is_named(setup, tmp_path):
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text("raise ImportError('no llama here')\n")
    with pytest.raises(PeerUnavailable, match="no llama here"):
        peer_perplexity(setup, [[0, 1]], threads=1)


def test_a_peer_needs_a_gguf_target_named_before_loading(tmp_path, capsys):
    rc = main(["perplexity", "--model", str(tmp_path), "--peer-python", sys.executable, "--out",
               str(tmp_path / "p.json")])
    assert rc != 0
    assert "GGUF" in capsys.readouterr().err
