"""int8 numerics (``specdec.quant.numerics``): a quantized target's integer arithmetic, batch-invariant.

The int8 kernel is its documented arithmetic (a float64 model of it from the blocks' bytes); it and the
row attention give a row the same bits alone or in any block, at any place, with any thread count and
in both builds; so a target in int8 numerics gives each row of a verify block, a tree, a ragged batch the
bits plain decoding gives it, and every drafter is token-identical to that target's plain decoding, with
drafts accepted, and samples its distribution.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import bigram_llama, sampled_pairs, tiny_llama
from specdec import SpecDecoder
from specdec.config import RuntimeConfig, use
from specdec.drafters import ModelDrafter, PromptLookupDrafter, Sources, SuffixDrafter
from specdec.drafters.self_spec import StreamingDrafter
from specdec.forward import forward_block
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.models import ModelLoadError, load_model
from specdec.quant import FORMATS, quantize_model
from specdec.quant.modules import QuantLinear
from specdec.formats import BlockFormat, dequantize, random_blocks
from specdec.quant.numerics import INT8_FORMATS, numerics_of, set_numerics
from specdec.registry import drafter_names, make_drafter
from specdec.runtime.int8_linear import INTERLEAVED, interleave
from specdec.tree import ancestor_mask
from test_quant_kernel import VARIANTS, _int8_model, _int8_parts, _ops, _q6_codes, _rounded_as

NEG = torch.finfo(torch.float32).min


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", INT8_FORMATS)
def test_the_kernel_is_its_arithmetic_for_any_rows(variant, name):
    """quant_linear_i8 equals the float64 model of its integer arithmetic to fp32 rounding, for 1-70 rows
    (row tiles and their remainders) and features not a multiple of its tiles, over the file's layout and
    the interleaved one (groups of 16 and the features past them), within the approximation bound of the
    exact reference."""
    ops = _ops(variant)
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    for rows, N, K in ((1, 9, 64), (5, 130, 96), (9, 16, 32), (70, 33, 576)):
        K = K if fmt.block_weights == 32 else 256 * (1 + K // 256)  # Q4_K: whole 256-weight blocks
        w = random_blocks(fmt, N, K, g)
        x = torch.randn(rows, K, generator=g)
        want = _int8_model(x, w, name)
        ref = F.linear(x, dequantize(w, fmt)).double()
        for blocks, code in ((w, fmt.ggml_type), (interleave(w, fmt), fmt.ggml_type | INTERLEAVED)):
            y = ops.quant_linear_i8(x, [blocks], [code]).double()
            assert ((y - want).abs() <= 1e-6 * _terms_bound(x, w, name) + 1e-30).all(), (variant, name, rows, N, K)
            assert (y - ref).norm() <= 0.05 * ref.norm()


@pytest.mark.parametrize("name", INT8_FORMATS)
def test_interleave_rearranges_the_bytes_of_whole_groups(name):
    """The interleaved copy has the blocks' shape and, per group of 16 features, the same bytes (Q8_0's
    codes offset by 128), rearranged (Q5_K's and Q6_K's codes as whole bytes: the same codes); the features
    past the last group untouched; a format the kernel lacks refused."""
    fmt = FORMATS[name]
    K = 96 if fmt.block_weights == 32 else 512
    w = random_blocks(fmt, 37, K, torch.Generator().manual_seed(4))
    wi = interleave(w, fmt)
    if name == "Q4_K":  # the scales unpacked to bytes: 4 bytes more per 256 weights; the tail's rows padded
        assert wi.shape == (37, 2 * 148) and torch.equal(wi[32:, :288], w[32:]) and not wi[32:, 288:].any()
        for g in range(2):  # the codes: the same bytes, rearranged
            codes = wi[16 * g:16 * g + 16].reshape(2, 16 * 148)[:, 320:]
            had = w[16 * g:16 * g + 16].reshape(16, 2, 144)[..., 16:]
            assert torch.equal(codes.flatten().sort().values, had.flatten().sort().values)
    elif name in ("Q5_K", "Q6_K"):  # their codes in planes: 180 / 210 bytes a feature and 256 weights
        size, wide = fmt.block_bytes, {"Q5_K": 180, "Q6_K": 210}[name]
        assert wi.shape == (37, 2 * wide) and torch.equal(wi[32:, :2 * size], w[32:]) and not wi[32:, 2 * size:].any()
        for g in range(2):
            blocks = w[16 * g:16 * g + 16].reshape(-1, size)
            had = _q6_codes(blocks) + 32 if name == "Q6_K" else _int8_parts(blocks, "Q5_K", 256)[0]
            codes = wi[16 * g:16 * g + 16].reshape(2, 16 * wide)[:, 320 if name == "Q5_K" else 288:]
            if name == "Q5_K":  # each code from its nibble and its fifth bit
                low, top = codes[:, :2048].reshape(2, 4, 8, 64), codes[:, 2048:].reshape(2, 8, 64)
                codes = torch.stack([((low[:, s // 2] >> 4 * (s % 2)) & 15) | (((top >> s) & 1) << 4)
                                     for s in range(8)], 1)
            if name == "Q6_K":  # each code from its low nibble and its top 2 bits
                low, top = codes[:, :2048].reshape(2, 8, 4, 64), codes[:, 2048:].reshape(2, 4, 4, 64)
                codes = torch.stack([((low[:, t // 2] >> 4 * (t % 2)) & 15) | (((top[:, t // 4] >> 2 * (t % 4)) & 3) << 4)
                                     for t in range(16)], 1)
            assert torch.equal(codes.flatten().sort().values, had.flatten().to(torch.uint8).sort().values)
    else:
        assert wi.shape == w.shape and wi.dtype == torch.uint8
        assert torch.equal(wi[32:], w[32:])
        for g in range(2):
            got, had = wi[16 * g:16 * g + 16].flatten(), w[16 * g:16 * g + 16].flatten()
            if name == "Q8_0":  # the codes biased: compare the scales' bytes and the codes apart
                blocks = had.reshape(-1, 34)
                had = torch.cat([blocks[:, :2].flatten(), (blocks[:, 2:] ^ 128).flatten()])
            assert torch.equal(got.sort().values, had.sort().values)
    assert not torch.equal(wi[:16], w[:16])
    q2_k = BlockFormat("Q2_K", 10, 256, 84, None, ())  # a GGML format no kernel here reads
    with pytest.raises(ValueError, match="multiplies Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K blocks, not Q2_K"):
        interleave(torch.zeros(16, 84, dtype=torch.uint8), q2_k)


def _terms_bound(x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
    """[M, N]: the sum over blocks of |D dx dot| + |M sx|, the magnitudes the kernel's fp32 sums add up
    (its rounding error is a small multiple of eps times this)."""
    q, D, M = _int8_parts(w, name, x.shape[1])
    xq, dx = _rounded_as(x, q)
    dots = torch.einsum("nbk,xbk->xnb", q, xq).abs()
    return torch.einsum("xnb,nb,xb->xn", dots, D.abs(), dx) + torch.einsum("nb,xb->xn", M.abs(), (dx * xq.sum(-1)).abs())


def test_a_layers_interleaved_copy_follows_its_blocks():
    """The copy is made once, and made again when the blocks change in place (not a stale copy)."""
    model = _int8_llama(2)
    layer = model.model.layers[0].mlp.up_proj
    first = layer.int8_blocks()
    assert layer.int8_blocks() is first and torch.equal(first, interleave(layer.blocks, layer.fmt))
    other = random_blocks(layer.fmt, *layer.blocks.shape[:1], layer.in_features, torch.Generator().manual_seed(8))
    layer.blocks.copy_(other)
    assert torch.equal(layer.int8_blocks(), interleave(other, layer.fmt))


@pytest.mark.parametrize("name", INT8_FORMATS)
def test_the_kernel_is_batch_invariant(name):
    """A row's outputs are bit-equal alone, in blocks of 2-64 rows at every place, split over parts, with
    1 and 2 threads, and in both builds (the same integers and the same float operations)."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(5)
    K = 192 if fmt.block_weights == 32 else 512
    w, w2 = random_blocks(fmt, 37, K, g), random_blocks(fmt, 11, K, g)
    x = torch.randn(64, K, generator=g)
    builds = [_ops(v) for v in VARIANTS]
    ops = builds[0]
    alone = torch.cat([ops.quant_linear_i8(x[i:i + 1], [w], [fmt.ggml_type]) for i in range(64)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for size in (2, 3, 4, 5, 8, 13, 64):
                for start in range(0, 64 - size + 1, max(1, (64 - size) // 3 or 1)):
                    block = ops.quant_linear_i8(x[start:start + size], [w], [fmt.ggml_type])
                    assert torch.equal(block, alone[start:start + size]), (t, size, start)
    finally:
        torch.set_num_threads(threads)
    parts = ops.quant_linear_i8(x, [w, w2], [fmt.ggml_type] * 2)
    assert torch.equal(parts[:, :37], alone)
    wi, code = interleave(w, fmt), fmt.ggml_type | INTERLEAVED
    for other in builds:  # each build, each layout, every block size: the same bits
        assert torch.equal(other.quant_linear_i8(x, [w], [fmt.ggml_type]), alone)
        for size in (1, 3, 8, 9, 64):
            got = torch.cat([other.quant_linear_i8(x[i:i + size], [wi], [code]) for i in range(0, 64, size)])
            assert torch.equal(got, alone), size
        mixed = other.quant_linear_i8(x, [wi, w2], [code, fmt.ggml_type])
        assert torch.equal(mixed[:, :37], alone) and torch.equal(mixed[:, 37:], parts[:, 37:])


# compiled head sizes (their rows in groups: 8 rows fill them, 7 leave one short, 3 take them one at a time)
# and the generic one; L = 70 and 69 leave keys past the last block of 4; past 1,024 keys the kernel asks for
# rows ahead of their turn (a row alone over its ~700 visible keys does not)
@pytest.mark.parametrize("D, R, L", [(64, 8, 70), (64, 7, 69), (64, 3, 70), (128, 8, 69), (24, 8, 70), (64, 3, 1101)])
def test_row_attention_is_each_rows_own_and_matches_sdpa(ops, D, R, L):
    """A row's attention is bit-equal over only its visible keys, in order, whatever is masked between
    them or before them, whatever the other rows and the store's length, in both builds;
    and equal to SDPA to fp32 rounding."""
    g = torch.Generator().manual_seed(9)
    B, H = 2, 3
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (R, L, L))
    bias = torch.where(torch.rand(B, 1, R, L, generator=g) < 0.3, NEG, 0.0)
    bias[..., 0] = 0.0  # every row sees a key
    bias[0, 0, 1, 8:24] = NEG  # a run of masked keys
    out = ops.row_attention(q, k, v, bias, 0.125)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.125)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for b in range(B):
        for r in range(R):
            seen = (bias[b, 0, r] == 0).nonzero().flatten()
            alone = ops.row_attention(q[b:b + 1, :, r:r + 1], k[b:b + 1, :, seen], v[b:b + 1, :, seen], None, 0.125)
            assert torch.equal(alone[0, :, 0], out[b, :, r]), (b, r)
            shifted = torch.cat([k[b:b + 1, :, :3], k[b:b + 1, :, seen]], 2)  # the same keys behind 3 masked ones
            late = torch.cat([torch.full((1, 1, 1, 3), NEG), torch.zeros(1, 1, 1, len(seen))], 3)
            alone = ops.row_attention(q[b:b + 1, :, r:r + 1], shifted, torch.cat([v[b:b + 1, :, :3], v[b:b + 1, :, seen]], 2),
                                      late, 0.125)
            assert torch.equal(alone[0, :, 0], out[b, :, r]), (b, r)
    Q = 2 if R % 2 == 0 else 1
    grouped = ops.row_attention(q, k, v, bias[:, :, :Q], 0.125)  # R = n x Q: row r takes bias row r % Q
    assert torch.equal(grouped[:, :, 2], ops.row_attention(q[:, :, 2:3], k, v, bias[:, :, :1], 0.125)[:, :, 0])
    for variant in VARIANTS:
        assert torch.equal(_ops(variant).row_attention(q, k, v, bias, 0.125), out), variant


@pytest.mark.parametrize("D, R, L", [(64, 8, 70), (64, 3, 69), (128, 7, 70), (24, 8, 70)])
def test_row_attention_reads_a_bf16_store_as_its_fp32_values(ops, D, R, L):
    """K/V held in bf16 (an int8 target's store) attend exactly as fp32 K/V of the same values: the row
    kernel widens them as it loads them, the arithmetic unchanged, in both builds."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, R, D, generator=g)
    k, v = (torch.randn(2, 3, L, D, generator=g).to(torch.bfloat16) for _ in range(2))
    bias = torch.where(torch.rand(2, 1, R, L, generator=g) < 0.3, NEG, 0.0)
    bias[..., 0] = 0.0
    want = ops.row_attention(q, k.float(), v.float(), bias, 0.125)
    for variant in VARIANTS:
        assert torch.equal(_ops(variant).row_attention(q, k, v, bias, 0.125), want), variant
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.row_attention(q, k, v.float(), bias, 0.125)


def test_an_int8_targets_store_holds_bf16_written_alike_by_the_one_call_and_the_loop(monkeypatch):
    """An int8 target's K/V store holds bf16 (an exact target's fp32); the compiled call's write (csrc/layers.cpp)
    rounds as the store's own (torch's copy), so the one call and the loop leave the same store and logits."""
    from test_quant import tiny_quant_llama
    from test_quant_kernel import one_call_and_loop

    assert BMCCache.for_model(tiny_quant_llama("Q4_1"), 1).kv_dtype is None  # exact numerics: the model's fp32
    stores = []  # the one call's, then the loop's

    def store(m, batch):
        stores.append(BMCCache.for_model(m, batch, BMCConfig(8)))
        return stores[-1]
    outs, calls = one_call_and_loop(_int8_llama(2), monkeypatch, store)
    assert calls["ran"] >= 2
    for (la, ha), (lb, hb) in zip(outs[True], outs[False]):
        assert torch.equal(la, lb) and torch.equal(ha, hb)
    for a, b in zip(stores[0].layers, stores[1].layers):
        assert a.keys.dtype == torch.bfloat16 and a.values.dtype == torch.bfloat16
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _int8_llama(seed: int = 0, fmt: str = "Q4_1"):
    model = tiny_llama(seed, layers=2).float()
    quantize_model(model, fmt)
    return set_numerics(model, "int8")


def test_a_model_takes_int8_only_with_every_linear_in_its_formats():
    model = tiny_llama(0).float()
    with pytest.raises(ValueError, match="holds fp32 weights"):
        set_numerics(model, "int8")
    with pytest.raises(ValueError, match="numerics='fast'"):
        set_numerics(model, "fast")
    quantize_model(model, "Q4_0")
    assert numerics_of(set_numerics(model, "int8")) == "int8"
    assert all(m.numerics == "int8" for m in model.modules() if hasattr(m, "numerics"))
    assert numerics_of(set_numerics(model, "exact")) == "exact"


def test_auto_numerics_is_int8_only_where_every_linear_can_take_it():
    """The commands' default (Numerics.AUTO resolved): int8 for a model whose linears are all int8 formats,
    exact for fp32 layers or a format the kernel does not multiply (here a stand-in for GGML's Q2_K)."""
    from specdec.quant.numerics import Numerics

    def resolve(model, numerics):
        return Numerics.parse(numerics).resolve(model)

    model = tiny_llama(0).float()
    assert resolve(model, "auto") == "exact"
    quantize_model(model, "Q4_1")
    assert resolve(model, "auto") == "int8" and resolve(model, "exact") == "exact"
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    other = quantize_model(LlamaForCausalLM(cfg).float().eval(), "Q4_K")
    assert resolve(other, "auto") == "int8"
    layer = other.model.layers[0].mlp.down_proj
    layer.fmt = BlockFormat("Q2_K", 10, 256, 84, None, ())  # what the resolve reads: the layer's format
    assert resolve(other, "auto") == "exact"


def test_numerics_is_one_typed_choice():
    """``Numerics``: a member or its name, compared as its name; a bad name refused naming the choices;
    AUTO a choice to resolve, never an arithmetic a model is set to."""
    from specdec.quant.numerics import Numerics

    assert Numerics.parse("int8") is Numerics.INT8 and Numerics.parse(Numerics.AUTO) is Numerics.AUTO
    assert Numerics.INT8 == "int8" and str(Numerics.EXACT) == "exact"
    with pytest.raises(ValueError, match="numerics='fast': expected one of exact, int8, auto"):
        Numerics.parse("fast")
    model = quantize_model(tiny_llama(0).float(), "Q4_0")
    assert Numerics.AUTO.resolve(model) is Numerics.INT8 and Numerics.EXACT.resolve(model) is Numerics.EXACT
    with pytest.raises(ValueError, match="numerics='auto': expected one of exact, int8"):
        set_numerics(model, Numerics.AUTO)
    assert numerics_of(set_numerics(model, "int8")) is Numerics.INT8


def test_load_model_refuses_int8_on_fp32_weights():
    with pytest.raises(ValueError, match="numerics='int8' is for quantized weights"):
        load_model("default", weights="fp32", numerics="int8")
    with pytest.raises(ValueError, match="numerics='fp8'"):
        load_model("default", weights="packed", numerics="fp8")


def _rows_one_at_a_time(model, history: list[int], path: list[int]) -> torch.Tensor:
    """Logits [len(path), V] of ``path`` after ``history``, every token its own 1-row block (plain decoding)."""
    cache = BMCCache.for_model(model, 1, BMCConfig(4))
    out = []
    for t in history + path:
        logits = forward_block(model, cache, torch.tensor([[t]]), None, None).logits
        cache.commit([[0]])
        out.append(logits[0, -1])
    return torch.stack(out[len(history):])


def _block_rows_vs_plain(model) -> list[bool]:
    """A chain block, a tree block and a ragged batch of two: per row compared, whether its logits are
    bit-equal to the same token decoded alone after its own history."""
    g = torch.Generator().manual_seed(2)
    hist = [torch.randint(1, 128, (9,), generator=g).tolist(), torch.randint(1, 128, (5,), generator=g).tolist()]
    same = []
    # a ragged batch: row 0 keeps 9 of its block of 9, row 1 keeps 5
    cache = BMCCache.for_model(model, 2, BMCConfig(8))
    first = forward_block(model, cache, torch.tensor([hist[0], hist[1] + [7, 7, 7, 7]]), None, None).logits
    for b in range(2):
        same.append(torch.equal(first[b, :len(hist[b])], _rows_one_at_a_time(model, [], hist[b])))
    cache.commit([list(range(9)), list(range(5))])
    # a tree block per row: the pending token, node a under it, nodes b and c both under a (siblings:
    # c's row sees a but not b, which sits between them in the store)
    mask = ancestor_mask(torch.tensor([[-1, 0, 0], [-1, 0, 0]]))  # [2, 4, 4] with the pending token's row
    depth = torch.tensor([[0, 1, 2, 2], [0, 1, 2, 2]])
    tokens = torch.randint(1, 128, (2, 4), generator=g)
    tree = forward_block(model, cache, tokens, mask, depth).logits
    for b in range(2):
        for node, path in ((2, [0, 1, 2]), (3, [0, 1, 3])):
            want = _rows_one_at_a_time(model, hist[b], tokens[b, path].tolist())[-1]
            same.append(torch.equal(tree[b, node], want))
    return same


def test_rows_of_chains_trees_and_ragged_batches_equal_plain_decoding_bit_for_bit():
    """Every row of a verify block (chain, tree with siblings, ragged batch) is plain decoding's row."""
    assert all(_block_rows_vs_plain(_int8_llama(1)))


@pytest.mark.filterwarnings("ignore:.*fits the budget")
def test_a_q4_k_target_is_batch_invariant_and_speculates_exactly():
    """A Q4_K target (256-weight blocks: hidden sizes of 256) in int8 numerics: verify rows bit-equal to
    plain decoding's, and drafters token-identical to its plain decoding with drafts accepted."""
    torch.manual_seed(6)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float().eval()
    quantize_model(model, "Q4_K")
    set_numerics(model, "int8")
    assert all(_block_rows_vs_plain(model))
    prompts = _prompts()
    plain = SpecDecoder(model, None).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    for drafter in (PromptLookupDrafter(), StreamingDrafter(model, budget=16, sink=2)):
        out = SpecDecoder(model, drafter).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
        assert [out.generated(b).tolist() for b in range(2)] == [plain.generated(b).tolist() for b in range(2)]
        assert sum(out.accepted_per_sequence) > 0


@pytest.mark.filterwarnings("ignore:.*fits the budget")
def test_a_q4_k_m_like_target_with_q5_k_and_q6_k_layers_speculates_exactly():
    """Q4_K_M files mix Q6_K (and Q5_K_M files Q5_K) into some tensors: with those layers in the int8 kernel
    too, every verify row is bit-equal to plain decoding's, and drafters match plain decoding token for token
    with drafts accepted."""
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float().eval()
    quantize_model(model, "Q4_K")
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:  # random blocks, small scales: the layer's size, the other format
        for mod, name, fmt in ((layer.mlp, "down_proj", "Q6_K"), (layer.self_attn, "v_proj", "Q5_K")):
            old = getattr(mod, name)
            blocks = random_blocks(FORMATS[fmt], old.out_features, old.in_features, g, scale=0.002)
            setattr(mod, name, QuantLinear(blocks, FORMATS[fmt], old.in_features))
    set_numerics(model, "int8")
    assert {m.fmt.name for m in model.modules() if isinstance(m, QuantLinear)} >= {"Q4_K", "Q5_K", "Q6_K"}
    assert all(_block_rows_vs_plain(model))
    prompts = _prompts()
    plain = SpecDecoder(model, None).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    out = SpecDecoder(model, StreamingDrafter(model, budget=16, sink=2)).generate(prompts, max_new_tokens=NEW,
                                                                                 eos_token_id=None)
    assert [out.generated(b).tolist() for b in range(2)] == [plain.generated(b).tolist() for b in range(2)]
    assert sum(out.accepted_per_sequence) > 0


def test_a_broken_invariance_is_caught(monkeypatch):
    """The bit test's premise: were a block's rows computed otherwise than one row alone (here: blocks of
    several rows through fp32 products, one row through the int8 kernel), it fails."""
    from specdec.runtime import int8_linear

    real = int8_linear.linear
    model = _int8_llama(1)
    files = {id(m.int8_blocks()): m.blocks for m in model.modules() if hasattr(m, "int8_blocks")}

    def by_rows(x, blocks, fmts, bias):
        if x.numel() // x.shape[-1] == 1:
            return real(x, blocks, fmts, bias)
        return F.linear(x, torch.cat([dequantize(files[id(b)], f) for b, f in zip(blocks, fmts)]), bias)

    monkeypatch.setattr(int8_linear, "linear", by_rows)
    assert not any(_block_rows_vs_plain(model))


NEW = 16


def _prompts() -> list[torch.Tensor]:
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(0))
    return [torch.cat([ids, ids]), torch.cat([ids[3:9], ids[3:9], ids[:4]])]


def _build(name: str, target):
    """Registered drafters that need a trained head or SmolLM2 answers get the contract test's model-free
    stand-ins (their acceptance is that test's subject); the rest their own factories."""
    if name in ("eagle", "eagle3", "eagle+lookup", "auto+eagle3", "suffix-corpus", "auto", "auto+quant-self"):
        return Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(),
                        "streaming": StreamingDrafter(target, budget=16, sink=2)})
    return make_drafter(name, target)


@pytest.mark.filterwarnings("ignore:.*fits the budget")
def test_every_drafter_equals_the_int8_targets_plain_decoding():
    """Greedy at batch 1 and in a ragged batch of two: each drafter's tokens are the int8 target's plain
    decoding's (not HF generate's: HF's attention is another arithmetic), with drafts accepted."""
    target = _int8_llama(4)
    prompts = _prompts()
    plain = SpecDecoder(target, None).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    for name in drafter_names():
        if name in ("none", "grammar"):  # grammar drafts what a constraint forces: test_constraints.py
            continue
        out = SpecDecoder(target, _build(name, target)).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
        for b in range(len(prompts)):
            assert out.generated(b).tolist() == plain.generated(b).tolist(), (name, b)
        assert sum(out.accepted_per_sequence) > 0, name


def test_sampling_on_an_int8_target_follows_its_distribution():
    """The first two sampled tokens after a one-token prompt, through a drafter whose q differs from the
    target's p, follow the int8 target's exact joint distribution (its own row forwards: a one-token
    prefill attends one key, which SDPA and the row attention give bit for bit); a wrong acceptance rule
    fails the same check."""
    from specdec.bench.distribution import pair_mismatch
    from specdec.sampling import SamplingParams, target_probs
    from specdec.verifiers import sampling as vs

    target = set_numerics(quantize_model(bigram_llama(6, peak=4.0).float(), "Q4_1"), "int8")  # peaked: a strong test
    prompt = torch.tensor([[5]])
    V = target.config.vocab_size
    params = SamplingParams.resolve(target, temperature=0.8)  # sampled_pairs' temperature, the model's top-k
    cache = BMCCache.for_model(target, V, BMCConfig(4))
    logits = forward_block(target, cache, torch.cat([prompt.expand(V, 1), torch.arange(V)[:, None]], 1), None, None).logits
    p1 = target_probs(logits[:1, :1], params)[0, 0]  # [V]
    p2 = target_probs(logits[:, 1:2], params)[:, 0]  # [V, V]: p(y | x)
    other = lambda: ModelDrafter(tiny_llama(7, layers=1).float())  # another model: its q is not the target's p
    pairs, drafted, accepted = sampled_pairs(target, other(), prompt, n=4000, batch=2000)
    assert 0 < accepted < drafted
    assert pair_mismatch(pairs, p1[:, None] * p2) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vs, "acceptance_probability", lambda p_x, q_x: torch.ones_like(p_x))
        wrong, _, _ = sampled_pairs(target, other(), prompt, n=4000, batch=2000)
    assert pair_mismatch(wrong, p1[:, None] * p2) is not None


def test_the_default_model_loads_in_int8_and_speculates_exactly(real_int8):
    ids = real_int8.tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to twelve in words."}],
                                                  add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    plain = SpecDecoder(real_int8.model, None).generate(ids, max_new_tokens=40)
    out = SpecDecoder(real_int8.model, make_drafter("prompt-lookup", real_int8.model)).generate(ids, max_new_tokens=40)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.accepted_per_sequence[0] > 0


@pytest.fixture(scope="module")
def real_int8():
    from specdec.models import default_gguf_path

    try:
        default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(f"the default model is not installed: {e}")
    with use(RuntimeConfig()):
        return load_model("default", weights="packed", numerics="int8")


def test_perplexity_through_the_store_scores_the_rows_decoding_computes():
    """`specdec perplexity --path decode`: a book's logits through verify blocks over the K/V store are the
    prefill's to fp32 rounding on an exact target, and on an int8 target (its store in bf16) the same bits for
    any block size, as its verify rows are."""
    from specdec.bench.perplexity import book_nll, store_logits
    from specdec.forward import prompt_logits

    g = torch.Generator().manual_seed(8)
    ids = torch.randint(1, 128, (1, 23), generator=g)
    exact = tiny_llama(4, layers=2).float()
    torch.testing.assert_close(store_logits(exact, ids, 5), prompt_logits(exact, ids), rtol=1e-4, atol=1e-4)
    model = _int8_llama(4)
    assert torch.equal(store_logits(model, ids, 4), store_logits(model, ids, 7))
    nll, n = book_nll(model, ids, "decode", 4)
    assert n == 22 and nll == pytest.approx(book_nll(model, ids)[0], rel=1e-2)  # close to its prefill's


def test_compressed_drafts_over_an_int8_targets_bf16_store_equal_its_plain_decoding():
    """Self-speculation on an int8 target: StreamingLLM's and SnapKV's stores hold the target store's bf16 rows
    (SnapKV's votes read them in fp32), prompts longer than the budget, drafts accepted; tokens equal plain
    decoding's at batch 1 and in a ragged batch of two."""
    from specdec.drafters.self_spec import SnapKVDrafter

    target = _int8_llama(4)
    prompts = _prompts()
    plain = SpecDecoder(target, None).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    for drafter in (StreamingDrafter(target, budget=8, sink=2, overshoot=4),
                    SnapKVDrafter(target, budget=8, window=4, kernel=3, overshoot=4)):
        out = SpecDecoder(target, drafter).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
        for b in range(len(prompts)):
            assert out.generated(b).tolist() == plain.generated(b).tolist(), (type(drafter).__name__, b)
        assert sum(out.accepted_per_sequence) > 0 and drafter.cache.kv_dtype == torch.bfloat16
        one = SpecDecoder(target, drafter).generate(prompts[1:], max_new_tokens=NEW, eos_token_id=None)
        assert one.generated(0).tolist() == plain.generated(1).tolist(), type(drafter).__name__
