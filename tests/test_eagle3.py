"""EAGLE-3: the target's aux hidden states (HF and fast path), the head's vocabulary maps, drafting that
is exact with a head that agrees in part, refusals by name, and the vLLM / SGLang / speculators files.
(The contract suite runs ``eagle3`` in every mode; the sampled trees' distribution: test_sampling.)"""

import json

import pytest
import torch

from conftest import agreeing_eagle3_head, bigram_llama, hf_greedy, ragged_blocks, tiny_llama
from specdec import SpecDecoder
from specdec.bench.runner import fixed_setting
from specdec.config import RuntimeConfig, use
from specdec.drafters import PromptLookupDrafter, Sources
from specdec.drafters.base import Prompt
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, lean_head
from specdec.drafters.eagle3 import Eagle3Drafter, make_eagle3
from specdec.drafters.eagle3_head import Eagle3Head, Eagle3HeadConfig, _LeanLayer, default_aux_layers, vocab_maps
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.tree import chain_mask
from specdec.drafters.eagle3_io import LAYOUTS, load_eagle3, save_eagle3
from specdec.forward import prefill
from specdec.registry import make_drafter

CONFIG = EagleConfig(total_tokens=6, depth=3, top_k=2)
EVEN = torch.arange(0, 128, 2)  # a reduced draft vocabulary: draft id i is target id 2i
MOST = torch.arange(128)[torch.arange(128) % 4 != 0]  # ... three quarters of the ids: 1, 2, 3, 5, ...


@pytest.fixture(scope="module")
def target():
    return tiny_llama(5, layers=3)


def _prompts() -> list[torch.Tensor]:
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))
    return [ids[:9], ids, torch.cat([ids[4:10], ids[4:10]])]


def _random_head(target, seed=3, **kw) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(target, **kw)
    with torch.no_grad():  # every tensor its own values, so a name swapped on disk shows
        for p in head.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.1)
    return head.eval()


# ------------------------------------------------------------------ the target's features

def test_aux_hidden_states_are_the_inputs_of_the_named_layers_on_both_paths(target):
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = target(ids, output_hidden_states=True).hidden_states  # [0] embeddings, [j] input of layer j
    for on in (True, False):
        with use(RuntimeConfig(fastpath=on)):
            got = prefill(target, ids, True, (2, 0, 1)).hidden
        torch.testing.assert_close(got, torch.cat([ref[2], ref[0], ref[1]], -1), atol=1e-10, rtol=0)
    fast, hf = (_blocks(target, on) for on in (True, False))
    for (_, a), (_, b) in zip(fast, hf):  # chains, a tree, a ragged SPLIT block
        assert a.shape[-1] == 3 * 64
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def _blocks(model, on):
    with use(RuntimeConfig(fastpath=on)):
        return ragged_blocks(model, layers=(1, 2, 0))


def test_default_layers_are_two_half_and_three_before_the_end():
    assert default_aux_layers(30) == (2, 15, 27) and default_aux_layers(2) == (1, 1, 0)


def test_vocab_maps_give_offsets_and_a_mask():
    d2t, t2d = vocab_maps(torch.tensor([3, 4, 9]), 10)
    assert d2t.tolist() == [3, 3, 7] and t2d.nonzero().flatten().tolist() == [3, 4, 9]
    with pytest.raises(ValueError, match="ascending"):
        vocab_maps(torch.tensor([4, 3]), 10)
    with pytest.raises(ValueError, match=r"lie in \[0, 10\)"):
        vocab_maps(torch.tensor([3, 10]), 10)


# ------------------------------------------------------------------------------ drafting

def test_an_agreeing_head_is_partly_accepted_and_exact_in_a_ragged_batch():
    target = bigram_llama(5)
    _exact_and_partly_accepted(target, Eagle3Drafter(target, agreeing_eagle3_head(target, MOST), CONFIG))


def _exact_and_partly_accepted(target, drafter) -> None:
    """Three prompts as one ragged batch, 16 tokens: each row HF's greedy answer, some drafts accepted (trees
    of a fixed size every step: the controller's gate follows measured times, which a loaded machine moves)."""
    prompts = _prompts()
    fixed = fixed_setting(f"n={CONFIG.total_tokens}")
    out = SpecDecoder(target, drafter, fixed).generate(prompts, max_new_tokens=16, eos_token_id=None)
    for b, p in enumerate(prompts):
        assert out.generated(b).tolist() == hf_greedy(target, p[None], 16)[0, len(p):].tolist(), f"row {b}"
    drafted = sum(sum(s.num_drafted) for s in out.steps)
    accepted = sum(sum(s.num_accepted) for s in out.steps)
    assert 0 < accepted < drafted


def test_drafts_are_target_ids_of_the_draft_vocabulary(target):
    drafter = Eagle3Drafter(target, _random_head(target, draft_vocab=torch.arange(1, 128, 3)), CONFIG)
    ids = _prompts()[1][None]
    hidden = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[j] for j in drafter.capabilities.hidden_layers], -1)[:, :-1]
    drafter.begin(Prompt(ids, torch.tensor([ids.shape[1]]), feats))
    tree = drafter.propose(6)
    assert tree.num_nodes.item() == 6 and bool((tree.tokens % 3 == 1).all())


def _modules_refused(head, monkeypatch):
    """Make the head's layer modules raise: a draft that completes ran the lean layer."""
    def refuse(*args, **kwargs):
        raise AssertionError("the head's modules ran, not the lean layer")
    monkeypatch.setattr(head.midlayer, "forward", refuse)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_lean_layer_computes_what_the_heads_modules_do(ops, monkeypatch, norm_before_residual):
    """A quantized head's draft forward by the lean ops (a chain of pairs, then a tree level seeing the
    chain, itself and one earlier node) against its modules, to fp32 rounding."""
    target = tiny_llama(5, layers=3, dtype=torch.float32)
    head = lean_head(_random_head(target, config=Eagle3HeadConfig(norm_before_residual=norm_before_residual)),
                     EagleConfig())
    assert _LeanLayer.of(head.midlayer) is not None
    g = torch.Generator().manual_seed(4)
    B, Q = 2, 5
    feats, toks = torch.randn(B, Q, head.feature_size, generator=g), torch.randint(0, 128, (B, Q), generator=g)
    outs = []
    for lean in (False, True):
        head._lean = None if lean else False
        cache = BMCCache(1, B, BMCConfig(period=8), torch.float32, torch.device("cpu"))
        with torch.inference_mode(), monkeypatch.context() as m:
            if lean:
                _modules_refused(head, m)
            inputs = cache.prepare(chain_mask(B, Q, torch.device("cpu")), torch.arange(Q).expand(B, Q))
            chain = head.draft(head.fuse(feats), toks, inputs.position_ids, inputs.attention_mask, cache)
            cache.commit([list(range(Q))] * B)
            tree = torch.tensor([[[True, False, False], [True, True, False], [False, False, True]]]).expand(B, 3, 3)
            inputs = cache.prepare(tree, torch.tensor([[0, 1, 0]]).expand(B, 3))
            level = head.draft(chain[:, 1:4], toks[:, :3], inputs.position_ids, inputs.attention_mask, cache)
        outs.append((chain, level))
    assert isinstance(head._lean, _LeanLayer)
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lean", [False, True])
def test_a_feed_wanting_each_rows_last_output_stores_every_pair(ops, monkeypatch, lean):
    """``draft(..., last=)`` (a catch-up's feed: only each row's last output is the tree's root) returns
    those rows of the whole chain's output, and leaves the store the whole chain leaves: a tree level
    drafted next sees the same keys (fails if the rows past ``last`` or before it miss the store)."""
    target = tiny_llama(5, layers=3, dtype=torch.float32)
    head = lean_head(_random_head(target), EagleConfig())
    head._lean = None if lean else False
    g = torch.Generator().manual_seed(5)
    B, Q = 2, 6
    feats, toks = torch.randn(B, Q, head.feature_size, generator=g), torch.randint(0, 128, (B, Q), generator=g)
    last = torch.tensor([5, 2])
    outs = []
    for wanted in (None, last):
        cache = BMCCache(1, B, BMCConfig(period=8), torch.float32, torch.device("cpu"))
        with torch.inference_mode(), monkeypatch.context() as m:
            if lean:
                _modules_refused(head, m)
            inputs = cache.prepare(chain_mask(B, Q, torch.device("cpu")), torch.arange(Q).expand(B, Q))
            chain = head.draft(head.fuse(feats), toks, inputs.position_ids, inputs.attention_mask, cache, last=wanted)
            cache.commit([list(range(Q))] * B)
            tree = torch.tensor([[[True, False], [True, True]]]).expand(B, 2, 2)
            inputs = cache.prepare(tree, torch.tensor([[0, 1]]).expand(B, 2))
            level = head.draft(feats[:, :2, : head.hidden_size], toks[:, :2], inputs.position_ids,
                               inputs.attention_mask, cache)
        outs.append((chain, level))
    (whole, level_whole), (rows, level_rows) = outs
    assert rows.shape == (B, 1, head.hidden_size)
    torch.testing.assert_close(rows[:, 0], whole[torch.arange(B), last], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(level_rows, level_whole, rtol=1e-5, atol=1e-5)


def test_a_quantized_head_drafts_by_the_lean_layer_exactly_in_a_ragged_batch(ops, monkeypatch):
    target = bigram_llama(5).to(torch.float32)
    head = lean_head(agreeing_eagle3_head(target, MOST), EagleConfig())
    _modules_refused(head, monkeypatch)
    _exact_and_partly_accepted(target, Eagle3Drafter(target, head, CONFIG))


def test_heads_draft_for_a_quantized_target_over_a_reduced_vocabulary(tmp_path):
    """A target whose output layer is blocks (no ``weight``): an EAGLE-3 head loads for it, EAGLE-1's reduced
    vocabulary reads its rows from the blocks, and both are exact."""
    from specdec.quant import QuantLinear, quantize_model

    target = quantize_model(tiny_llama(5, layers=3, dtype=torch.float32), "Q8_0")
    assert isinstance(target.get_output_embeddings(), QuantLinear)
    save_eagle3(_random_head(target, draft_vocab=EVEN), tmp_path)
    eagle1 = EagleHead(target, draft_vocab=EVEN)
    lm = target.get_output_embeddings()
    torch.testing.assert_close(eagle1.logits(torch.ones(1, 64)), lm.reference(torch.ones(1, 64))[:, EVEN])
    ids = _prompts()[1][None]
    for drafter in (Eagle3Drafter(target, load_eagle3(tmp_path, target), CONFIG), EagleDrafter(target, eagle1, CONFIG)):
        out = SpecDecoder(target, drafter, fixed_setting("n=6")).generate(ids, max_new_tokens=10, eos_token_id=None)
        assert torch.equal(out.sequences, hf_greedy(target, ids, 10)), type(drafter).__name__


def test_a_chooser_refuses_sources_reading_different_features(target):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="read different target hidden states"):
        Sources({"lookup": PromptLookupDrafter(), "eagle": EagleDrafter(target, EagleHead(target)),
                 "eagle3": Eagle3Drafter(target, _random_head(target))})


def _llama(hidden=64, layers=3, vocab=128):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.mark.parametrize("what, other", [("hidden size", dict(hidden=96)), ("layer count", dict(layers=4)),
                                         ("vocabulary", dict(vocab=96))])
def test_a_head_for_another_target_is_refused_by_name(target, tmp_path, what, other):
    head, other = _random_head(target), _llama(**other)
    with pytest.raises(ValueError, match=f"{what} .* \\(head\\) != .* \\(target\\)"):
        Eagle3Drafter(other, head)
    save_eagle3(head, tmp_path)
    with pytest.raises(ValueError, match=f"target {what} .* \\(head\\) != .* \\(target\\)"):
        load_eagle3(tmp_path, other)


def test_an_eagle1_head_is_not_an_eagle3_head(target):
    with pytest.raises(TypeError, match="Eagle3Head"):
        Eagle3Drafter(target, EagleHead(target))


def test_registry_eagle3_names_how_to_get_a_head(target):
    with pytest.raises(ValueError, match="train-eagle --arch eagle3"):
        make_eagle3(target)


def test_a_configured_head_drafts_by_name_and_takes_eagles_place_in_auto(target, tmp_path):
    save_eagle3(_random_head(target, draft_vocab=EVEN), tmp_path, "sglang")
    with use(RuntimeConfig(eagle3_head=tmp_path)):
        named, auto = make_drafter("eagle3", target), make_drafter("auto", target)
    assert isinstance(named, Eagle3Drafter) and named.capabilities.hidden_layers == (2, 1, 0)
    assert "eagle3" in auto.sources and "eagle" not in auto.sources
    assert auto.capabilities.hidden_layers == (2, 1, 0)
    ids = _prompts()[1][None]
    out = SpecDecoder(target, auto).generate(ids, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 10))


# ------------------------------------------------------------------------------- files

def _drafts(target, head) -> torch.Tensor:
    drafter = Eagle3Drafter(target, head, CONFIG)
    # trees of a fixed size: the controller's choices follow measured times (they differ run to run)
    fixed = fixed_setting(f"n={CONFIG.total_tokens}")
    out = SpecDecoder(target, drafter, fixed).generate(_prompts()[:2], max_new_tokens=6, eos_token_id=None)
    return torch.tensor([sum(s.num_accepted) for s in out.steps] + [sum(s.num_drafted) for s in out.steps])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_round_trips_tensors_and_drafts(target, tmp_path, layout):
    """Its own layer shaped apart from the target's (a narrower MLP, 2 query heads, 1 K/V head), other
    fused layers, a draft vocabulary of odd ids: save, load, the same tensors and the same drafts."""
    head = _random_head(target, draft_vocab=EVEN[:40] + 1, config=Eagle3HeadConfig(aux_layers=(2, 1, 1)),
                        layer={"intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1})
    save_eagle3(head, tmp_path, layout)
    cfg = json.loads((tmp_path / "config.json").read_text())
    back = load_eagle3(tmp_path, target)
    assert back.aux_layers == (2, 1, 1) and cfg["draft_vocab_size"] == 40
    want = {"vllm": [2, 1, 1], "sglang": [1, 0, 0], "speculators": [2, 1, 1]}[layout]
    assert cfg.get("eagle_aux_hidden_state_layer_ids") == want  # SGLang counts layer outputs
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(_drafts(target, head), _drafts(target, back))


def test_sglang_cannot_name_the_embeddings_as_a_fused_layer(target, tmp_path):
    head = _random_head(target, config=Eagle3HeadConfig(aux_layers=(0, 1, 2)))
    save_eagle3(head, tmp_path, "vllm")
    with pytest.raises(ValueError, match="sglang layout cannot name the embeddings"):
        save_eagle3(head, tmp_path, "sglang")


def test_engine_layouts_name_their_tensors_as_the_engines_do(target, tmp_path):
    from safetensors.torch import load_file

    head = _random_head(target, draft_vocab=EVEN)
    save_eagle3(head, tmp_path / "v", "vllm")
    save_eagle3(head, tmp_path / "s", "speculators")
    names = set(load_file(str(tmp_path / "v" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    assert load_file(str(tmp_path / "v" / "model.safetensors"))["midlayer.self_attn.q_proj.weight"].shape[1] == 128
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    assert spec["speculators_config"]["algorithm"] == "eagle3"
    assert "layers.0.self_attn.k_proj.weight" in load_file(str(tmp_path / "s" / "model.safetensors"))


def test_an_engine_head_with_default_layers_and_the_targets_embedding_loads(tmp_path):
    """A head as the engines ship it for a 6-layer target: no layer ids (the default 2, 3, 3), the
    embedding stored beside it; bf16 weights."""
    from safetensors.torch import load_file, save_file

    big = tiny_llama(4, layers=6)
    head = _random_head(big, draft_vocab=EVEN)
    save_eagle3(head, tmp_path, "sglang", dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["embed_tokens.weight"] = big.model.embed_tokens.weight.detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = load_eagle3(tmp_path, big)
    assert back.aux_layers == (2, 3, 3)
    torch.testing.assert_close(back.fc.weight, head.fc.weight, atol=1e-2, rtol=1e-2)
    tensors["embed_tokens.weight"] += 1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="its own embed_tokens"):
        load_eagle3(tmp_path, big)
