"""Bad input gets one clear error naming the problem."""

import json

import pytest
import torch

from conftest import tiny_llama
from specdec import SpecDecoder
from specdec.drafters import ModelDrafter
from specdec.models import ModelLoadError, load_model


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="empty prompt"):
        SpecDecoder(target).generate(torch.zeros(1, 0, dtype=torch.long))


def test_prompt_over_context_window():
    target = tiny_llama(0, max_pos=32)
    with pytest.raises(ValueError, match="does not fit the model's context window of 32"):
        SpecDecoder(target).generate(torch.zeros(1, 32, dtype=torch.long))


def test_vocabulary_mismatch(target):
    other = tiny_llama(1, vocab=100)
    with pytest.raises(ValueError, match=r"drafter vocabulary \(100 tokens\) does not match the target's \(128"):
        SpecDecoder(target, ModelDrafter(other))


def test_attention_mask_of_another_shape_is_named(target):
    with pytest.raises(ValueError, match=r"attention_mask shape \(2, 3\) does not match input_ids shape \(2, 4\)"):
        SpecDecoder(target).generate(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3))


def test_a_sequence_of_zero_real_tokens_is_named(target):
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match="empty prompt: sequence 1 has no tokens"):
        SpecDecoder(target).generate(torch.ones(2, 3, dtype=torch.long), attention_mask=mask)
    with pytest.raises(ValueError, match="empty prompt: sequence 2 has no tokens"):
        SpecDecoder(target).generate([[1, 2], [3], []])


def test_a_drafter_that_cannot_batch_says_so(target):
    from specdec.drafters.base import Drafter
    from specdec.tree import DraftTree

    class OneAtATime(Drafter):
        def begin(self, prompt):
            pass

        def propose(self, budget):
            return DraftTree.empty(1)

        def accept(self, commit):
            pass

    assert not OneAtATime().capabilities.batches
    with pytest.raises(ValueError, match="OneAtATime cannot draft for a batch of 2 sequences"):
        SpecDecoder(target, OneAtATime()).generate([[1, 2], [3]])


def test_a_streamer_takes_one_sequence(target):
    class Streamer:
        def put(self, t):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="a streamer takes one sequence"):
        SpecDecoder(target).generate([[1, 2], [3]], streamer=Streamer())


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at"):
        load_model(str(tmp_path / "nothing"))


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_model(str(tmp_path))


def test_corrupt_safetensors_is_named(tmp_path, target):
    target.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])  # truncated download
    with pytest.raises(ModelLoadError, match="corrupt weights file .*model.safetensors"):
        load_model(str(tmp_path))


def test_hf_directory_roundtrip(tmp_path, target):
    target.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded.model(ids).logits, target(ids).logits)


@pytest.mark.parametrize("sizes", ["1,x", "0,2", ""])
def test_bench_verify_sizes_are_named_before_any_model_loads(sizes, monkeypatch):
    import argparse

    from specdec.bench import verify_cost

    monkeypatch.setattr("specdec.models.load_model", lambda *a, **k: pytest.fail("model loaded first"))
    args = argparse.Namespace(model="default", context=200, repeats=1, sizes=sizes, threads=None, out=None,
                              kernel=None)
    with pytest.raises(ValueError, match="--sizes: positive block sizes"):
        verify_cost.run(args)


def test_bench_verify_quantized_weights_only_in_place(monkeypatch):
    import argparse

    from specdec.bench import verify_cost

    monkeypatch.setattr("specdec.models.load_model", lambda *a, **k: pytest.fail("model loaded first"))
    args = argparse.Namespace(model="default", context=200, repeats=1, sizes="1,2", threads=None, out=None,
                              kernel=None, weights="packed", in_decoder=False)
    with pytest.raises(ValueError, match="--weights packed: only with --in-decoder"):
        verify_cost.run(args)


# ---------------------------------------------------------------- command-line numbers, at parse time

BAD_ARGUMENTS = [  # (argv, the line's tail): each fails while parsing, before any model loads
    (["generate", "hi", "--max-new-tokens", "-5"], "--max-new-tokens must be a positive integer, got '-5'"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be a number >= 0, got '-1'"),
    (["generate", "hi", "--temperature", "nan"], "--temperature must be a number >= 0, got 'nan'"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p must be a number in (0, 1], got '1.5'"),
    (["generate", "hi", "--top-k", "-3"], "--top-k must be an integer >= 0, got '-3'"),
    (["chat", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got '0'"),
    (["specbench", "--batch-size", "0"], "--batch-size must be a positive integer, got '0'"),
    (["specbench", "--limit-per-category", "x"], "--limit-per-category must be a positive integer, got 'x'"),
    (["bench", "--per-category", "-1"], "--per-category must be a positive integer, got '-1'"),
    (["bench", "--batch-size", "1,x"], "--batch-size must be comma-separated integers, got '1,x'"),
    (["bench", "--batch-size", "0,2"], "--batch-size must be positive integers, got '0,2'"),
    (["bench-longctx", "--budgets", "256,0"], "--budgets must be positive integers, got '256,0'"),
    (["bench-controller", "--noise", "-0.1"], "--noise must be a number >= 0, got '-0.1'"),
    (["train-eagle", "--out", "x", "--steps", "0"], "--steps must be a positive integer, got '0'"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_ARGUMENTS])
def test_a_bad_number_is_named_in_one_line_before_any_model_loads(argv, message, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.setattr("specdec.models.load_model", lambda *a, **k: pytest.fail("model loaded first"))
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == f"specdec {argv[0]}: error: {message}\n"  # one line: no usage block, no traceback


def test_argument_types_accept_what_they_promise():
    from specdec.arguments import int_list, name_list, non_negative_float, non_negative_int, positive_int, probability

    assert positive_int("3") == 3 and non_negative_int("0") == 0 and non_negative_float("0") == 0.0
    assert probability("1") == 1.0 and probability("0.9") == 0.9
    assert int_list("1024, 2048") == [1024, 2048] and name_list("none,prompt-lookup,") == ["none", "prompt-lookup"]


@pytest.mark.parametrize("bad", [-5, 2.5, "8"])
def test_generate_names_a_bad_max_new_tokens(target, bad):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be a whole number >= 0, got {bad!r}"):
        SpecDecoder(target).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=bad)
