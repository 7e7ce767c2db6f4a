"""The lean Llama-family forward (specdec.fastpath) against HF's own forward.

The tiny Llama every other test decodes with takes this path, so the whole lossless suite runs
through it; here: that it is taken, that Qwen2 (q/k/v biases) and Mistral agree with HF's modules
on chains, trees, ragged batches (PAD and SPLIT) and hidden states, that what it cannot reproduce
runs HF's forward, and that HF's forward stays exact when the path is off.
"""

import logging

import pytest
import torch
import torch.nn as nn
from transformers import (LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from conftest import hf_greedy, perturbed, ragged_blocks, tiny_llama
from specdec.config import RuntimeConfig, use
from specdec import fastpath
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters.model import ModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.forward import forward_block
from specdec.kv.bmc import BMCCache, BMCConfig

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=None, pad_token_id=0)


def _model(cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64).eval()
    for m in model.modules():  # Qwen2 initialises its q/k/v biases to zero: make them count
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.normal_(m.bias, std=0.5)
    return model


def qwen2(**kw):
    return _model(Qwen2ForCausalLM, Qwen2Config(**SHAPE, use_sliding_window=False, **kw))


def mistral(**kw):
    return _model(MistralForCausalLM, MistralConfig(**SHAPE, **{"sliding_window": None, **kw}))


def _blocks(model, on: bool):
    with use(RuntimeConfig(fastpath=on)):
        return ragged_blocks(model)


@pytest.mark.parametrize("make", [lambda: tiny_llama(3), qwen2, mistral], ids=["llama", "qwen2-bias", "mistral"])
def test_fast_path_matches_hf_forward(make):
    model = make()
    assert fastpath.get(model) is not None, "this model should take the fast path"
    fast, hf = _blocks(model, True), _blocks(model, False)
    for (lf, hf_), (lh, hh) in zip(fast, hf):
        torch.testing.assert_close(lf, lh, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(hf_, hh, atol=1e-10, rtol=1e-10)


def test_fast_path_is_what_runs(monkeypatch):
    """With the path on, HF's module forward is never called for a block (so the suite tests the path)."""
    model = tiny_llama(5)
    monkeypatch.setattr(LlamaForCausalLM, "forward", lambda *a, **k: pytest.fail("HF forward called"))
    cache = BMCCache.for_model(model, 1, BMCConfig(8))
    monkeypatch.setattr(fastpath.FastPath, "agrees", lambda self, model: True)  # its check calls HF's forward
    forward_block(model, cache, torch.tensor([[1, 2, 3]]), None, None)


@pytest.mark.parametrize("make", [lambda: mistral(sliding_window=64),
                                  lambda: _model(Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=16))],
                         ids=["mistral-sliding-window", "qwen3-qk-norm"])
def test_unsupported_models_run_hf_forward(make):
    model = make()
    assert fastpath.get(model) is None
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    got = SpecDecoder(model, PromptLookupDrafter()).generate(ids, max_new_tokens=12).sequences
    assert torch.equal(got, hf_greedy(model, ids, 12))


def test_text_past_a_sliding_window_is_refused():
    """The KV store attends to every row: past a sliding window it would not be the target's output."""
    model = mistral(sliding_window=16)
    with pytest.raises(ValueError, match="sliding window of 16 tokens.*prompt of 6 tokens"):
        SpecDecoder(model).generate(torch.tensor([[1, 2, 3, 4, 5, 6]]), max_new_tokens=11)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert torch.equal(SpecDecoder(model).generate(ids, max_new_tokens=10).sequences, hf_greedy(model, ids, 10))


def test_a_model_the_path_would_get_wrong_is_caught_by_its_check(caplog):
    """A Llama whose MLP was given another activation (its config still says silu): the build-time check
    disagrees, a warning says so, and decoding runs HF's forward, still exact."""
    model = tiny_llama(6)
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.GELU()
    with caplog.at_level(logging.WARNING, logger="specdec.fastpath"):
        assert fastpath.get(model) is None
    assert "disagrees with HF's forward" in caplog.text
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    got = SpecDecoder(model, PromptLookupDrafter()).generate(ids, max_new_tokens=12).sequences
    assert torch.equal(got, hf_greedy(model, ids, 12))


def test_a_model_is_freed_with_its_path():
    import gc
    import weakref

    model = tiny_llama(8)
    assert fastpath.get(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the path kept its model alive"


def test_weights_changed_in_place_rebuild_the_fused_copies():
    model = tiny_llama(7)
    first = fastpath.get(model)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        model.model.layers[1].mlp.up_proj.weight.add_(0.01)
    assert first.stale()
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    got = SpecDecoder(model, PromptLookupDrafter()).generate(ids, max_new_tokens=12).sequences
    assert fastpath.get(model) is not first
    assert torch.equal(got, hf_greedy(model, ids, 12))


@pytest.mark.parametrize("seed", range(3))
def test_hf_forward_stays_exact_with_the_path_off(seed, monkeypatch):
    """The path off: a partly agreeing drafter on a ragged batch of two, token for token as HF greedy."""
    model = tiny_llama(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (n,), generator=g) for n in (7, 12)]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 12 - len(p):], mask[b, 12 - len(p):] = p, 1  # left-padded, as HF batches
    off = SpecDecoderConfig(runtime=RuntimeConfig(fastpath=False))
    out = SpecDecoder(model, ModelDrafter(perturbed(model, 0.3, seed)), off).generate(ids, attention_mask=mask,
                                                                                      max_new_tokens=16)
    assert model not in fastpath._paths  # never built: HF's forward ran every block
    for b, p in enumerate(prompts):
        assert out.sequences[b, 12 : 12 + 16].tolist() == hf_greedy(model, p[None], 16)[0, len(p):].tolist()


def test_bad_switch_value_is_an_error():
    with pytest.raises(ValueError, match="SPECDEC_FASTPATH='yes'"):
        RuntimeConfig.from_environ({"SPECDEC_FASTPATH": "yes"})


def test_warm_up_builds_the_path_and_leaves_the_controller_unmeasured():
    target = tiny_llama(5, dtype=torch.float32)
    dec = SpecDecoder(target, PromptLookupDrafter())
    assert target not in fastpath._paths
    dec.warm_up()
    assert fastpath._paths.get(target) is not None  # built and checked: not in the first timed generate
    assert dec.controller.classes == {} and dec.controller.step_time == {} and dec.controller.draft_time == 0.0
    from specdec.drafters.suffix import SuffixDrafter

    corpus_drafter = SuffixDrafter.from_corpus([[5, 6, 7, 8]])
    SpecDecoder(target, corpus_drafter).warm_up()
    assert corpus_drafter.corpus._index is not None  # indexed now, not in the first timed generate
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    out = dec.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 16))
