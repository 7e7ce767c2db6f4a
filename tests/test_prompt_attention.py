"""The prompt attention of a target in int8 numerics (``csrc/prompt_attention.cpp``): a prompt's causal
attention over itself with bf16 products. Pinned: it is causal attention of the bf16-rounded inputs (to the
rounding of the weights), a row's output depends only on its query and the keys up to it (bit-equal in a
shorter prompt, with any thread count), and an int8 target's prefill takes it where an exact one does not.
Skipped where the build has no AVX512-BF16."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specdec.runtime.attention as attention
from specdec.forward import prefill
from specdec.quant import quantize_model
from specdec.quant.numerics import set_numerics


@pytest.fixture
def bf16_ops(ops):
    if not ops.prompt_attention_supports(64):
        pytest.skip("this build has no AVX512-BF16 prompt attention (the prefill keeps SDPA's causal path)")
    return ops


def _reference(q, k, v, scale):
    """float64 causal attention of bf16-rounded q, k, v; q grouped [B, H, n * Q, D] (row r * Q + i)."""
    B, H, R, D = q.shape
    Q = k.shape[2]
    q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
    s = torch.einsum("bhnqd,bhkd->bhnqk", q.view(B, H, R // Q, Q, D), k) * scale
    s = s.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v[:, :, None]).reshape(B, H, R, D)


@pytest.mark.parametrize("D", [64, 128])
def test_prompt_attention_is_causal_attention_of_bf16_inputs(bf16_ops, D):
    """Row tiles of 1-4 grouped heads (5: a tile and its remainder), prompts shorter than a block of 32 keys,
    one key past it, several blocks; the only rounding left is the weights' bf16 and fp32 sums."""
    g = torch.Generator().manual_seed(0)
    for n, Q in ((1, 1), (3, 2), (5, 31), (2, 32), (3, 33), (4, 70)):
        q, k, v = (torch.randn(2, 2, m, D, generator=g) for m in (n * Q, Q, Q))
        out = bf16_ops.prompt_attention(q, k, v, D**-0.5)
        err = (out.double() - _reference(q, k, v, D**-0.5)).abs().max().item()
        assert err < 2e-2, (n, Q, err)


def test_a_bf16_store_is_read_as_held(bf16_ops):
    """K/V from a store that holds bf16 (an int8 target's) give the bits of the fp32 values they round from:
    the kernel rounds fp32 K/V to bf16 (round to nearest even, as the store's write does) and takes bf16 as is."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 3, m, 64, generator=g) for m in (2 * 37, 37, 37))
    want = bf16_ops.prompt_attention(q, k, v, 0.125)
    assert torch.equal(bf16_ops.prompt_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), 0.125), want)


def test_a_rows_output_is_its_own(bf16_ops):
    """Bit-equal in a prompt cut after it, and with one thread or two: nothing but its query and the keys up
    to it reach a row (why the prefill of a prompt is the same whatever follows it)."""
    g = torch.Generator().manual_seed(1)
    n, Q, D = 3, 77, 64
    q, k, v = (torch.randn(1, 3, m, D, generator=g) for m in (n * Q, Q, Q))
    full = bf16_ops.prompt_attention(q, k, v, 0.125)
    for P in (1, 32, 40):
        cut = bf16_ops.prompt_attention(q.view(1, 3, n, Q, D)[:, :, :, :P].reshape(1, 3, n * P, D).contiguous(),
                                        k[:, :, :P].contiguous(), v[:, :, :P].contiguous(), 0.125)
        assert torch.equal(cut.view(1, 3, n, P, D), full.view(1, 3, n, Q, D)[:, :, :, :P]), P
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16_ops.prompt_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


def _int8_target(numerics: str):
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # head size 64
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    quantize_model(model, "Q4_1")
    return set_numerics(model, numerics)


def test_an_int8_targets_prefill_takes_it_and_an_exact_ones_does_not(bf16_ops, monkeypatch):
    calls = []
    real = attention.prompt_attention

    def counted(*a):
        calls.append(a[0].shape)
        return real(*a)

    monkeypatch.setattr(attention, "prompt_attention", counted)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    exact = prefill(_int8_target("exact"), ids)
    assert calls == []
    int8 = prefill(_int8_target("int8"), ids)
    assert len(calls) == 2  # every layer
    torch.testing.assert_close(int8.logits, exact.logits, rtol=0.1, atol=0.1)  # int8's rounding, bf16's


def test_the_avx2_build_has_none_and_the_prefill_keeps_sdpa(monkeypatch):
    """Builds without AVX512-BF16 (the AVX2 one on any CPU) refuse the op by its support query, and an int8
    target's prefill then attends by SDPA's causal path, as exact numerics does."""
    from specdec.config import RuntimeConfig, use
    from specdec.runtime import kernels

    avx2 = kernels.extension(RuntimeConfig(kernel="avx2"))
    if avx2 is None:
        pytest.skip("the avx2 kernel is not built here")
    assert not avx2.prompt_attention_supports(64)
    taken = []
    real = attention.prompt_attention
    monkeypatch.setattr(attention, "prompt_attention", lambda *a: taken.append(real(*a)) or taken[-1])
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with use(RuntimeConfig(kernel="avx2")):
        out = prefill(_int8_target("int8"), ids)
    assert taken == [None, None] and torch.isfinite(out.logits).all()


def test_an_int8_prefill_is_each_prompts_own(bf16_ops):
    """With the prompt attention and the batch-invariant int8 linears, a prompt's prefill (logits and every
    layer's K/V) is bit-equal prefilled alone or beside others, and its first P rows equal a prefill of
    its first P tokens."""
    model = _int8_target("int8")
    ids = torch.randint(0, 96, (3, 50), generator=torch.Generator().manual_seed(3))
    both = prefill(model, ids)
    for b in range(3):
        one = prefill(model, ids[b:b + 1])
        assert torch.equal(one.logits[0], both.logits[b])
        assert all(torch.equal(k[0], kb[b]) and torch.equal(v[0], vb[b]) for (k, v), (kb, vb) in zip(one.layers, both.layers))
    short = prefill(model, ids[:, :30])
    assert all(torch.equal(k, kb[:, :, :30]) and torch.equal(v, vb[:, :, :30]) for (k, v), (kb, vb) in zip(short.layers, both.layers))


def test_a_prompt_in_pieces_gets_the_bits_of_one_piece(bf16_ops):
    """The kernel takes keys before the block (a prefix's rows): the rows after a prefix of any length, a
    single row included, equal the one-forward prefill's; so the prefix cache's prefill (``prefill_aligned``)
    takes one forward after what it reuses and gives the bits of no reuse."""
    from specdec.forward import prefill_after, prefill_aligned

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, m, 64, generator=g) for m in (3 * 40, 40, 40))
    whole = bf16_ops.prompt_attention(q, k, v, 0.125, 0)
    for past in (1, 31, 32, 39):
        block = q.view(1, 2, 3, 40, 64)[:, :, :, past:].reshape(1, 2, 3 * (40 - past), 64).contiguous()
        got = bf16_ops.prompt_attention(block, k, v, 0.125, past)
        assert torch.equal(got.view(1, 2, 3, 40 - past, 64), whole.view(1, 2, 3, 40, 64)[:, :, :, past:]), past
    model = _int8_target("int8")
    ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(5))
    one = prefill(model, ids[None])
    for n in (0, 16, 32, 49):
        prefix = [(kk[0, :, :n], vv[0, :, :n]) for kk, vv in one.layers] if n else None
        aligned = [prefill_aligned(model, ids, 16, prefix)] if n % 16 == 0 else []  # its prefixes: whole blocks
        for pieces in [prefill_after(model, ids, prefix)] + aligned:
            assert torch.equal(pieces.logits, one.logits), n
            assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(pieces.layers, one.layers) for a, b in ((ka, kb), (va, vb))), n
