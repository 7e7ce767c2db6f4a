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
