"""The attention kernel (specdec/runtime/csrc/decode_attention.cpp): grouped query rows over a KV store,
against torch's SDPA on random shapes, masks and store views, and a decoder through it still exact."""

import platform
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import hf_greedy, perturbed, tiny_llama
from specdec.config import RuntimeConfig, use
from specdec.runtime import attention as attn
from specdec.runtime import calibrate, kernels, state
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters import ModelDrafter, PromptLookupDrafter

MIN = torch.finfo(torch.float32).min


def _sdpa(q, k, v, bias, n, scale):
    """SDPA with the bias repeated for the n grouped rows of each query position, as the decoder did."""
    mask = None if bias is None else bias.repeat(1, 1, n, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def test_random_shapes_masks_and_store_views_agree_with_sdpa(ops):
    """400 random cases: batch 1-4, 1-4 KV heads, 1-4 query heads a group, blocks of 1-16 rows, 1-900
    keys (splits of a head's keys across threads included), head sizes 16-128, keys and values as
    views of a larger store, masks with dtype-min and -inf, one mask for every sequence or one each."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    sizes = [d for d in (16, 32, 64, 128) if ops.attention_supports(d)]
    for case in range(400):
        B, H, n, D = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4), rng.choice(sizes)
        Q = rng.randint(1, min(16, kernels.ATTENTION_ROWS // n))
        L = rng.randint(Q, 900)
        cap = L + rng.randint(0, 40)  # the store's capacity: k/v are views of its first L rows
        k = torch.randn(B, H, cap, D, generator=g)[:, :, :L]
        v = torch.randn(B, H, cap, D, generator=g)[:, :, :L]
        q = torch.randn(B, H, n * Q, D, generator=g)
        bias = None
        if rng.random() < 0.8:
            bias = torch.zeros(rng.choice([1, B]), 1, Q, L)
            hide = torch.rand(bias.shape, generator=g) < rng.random() * 0.9
            bias.masked_fill_(hide, rng.choice([MIN, float("-inf")]))
            own = bias[..., L - Q:]
            bias[..., L - Q:] = torch.where(torch.eye(Q, dtype=torch.bool), 0.0, own)  # each row sees itself
        scale = D**-0.5
        got = ops.attention(q, k, v, bias, scale)
        want = _sdpa(q, k, v, bias, n, scale)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"case {case}: {m}")


@pytest.mark.parametrize("variant", ["native", "avx2"] if platform.machine() in ("x86_64", "AMD64") else ["native"])
def test_every_row_count_agrees_with_sdpa(variant):
    """Every row count 1-64, both builds: each shape (a key dotted with every row under 12 rows; rows as
    lanes from 12, where AVX-512 mixes 16-lane vectors with an 8-lane last one for 17-24, 33-40 and
    49-56 rows), with query positions masked differently and keys split across threads."""
    ops = kernels.extension(RuntimeConfig(kernel=variant))
    if ops is None:
        pytest.skip(f"the {variant} kernel is not built here")
    g = torch.Generator().manual_seed(1)
    for R in range(1, kernels.ATTENTION_ROWS + 1):
        Q = next(q for q in (4, 3, 2, 1) if R % q == 0)
        L = 150 + R
        k, v = torch.randn(1, 2, L, 64, generator=g), torch.randn(1, 2, L, 64, generator=g)
        q = torch.randn(1, 2, R, 64, generator=g)
        bias = torch.zeros(1, 1, Q, L).masked_fill_(torch.rand(1, 1, Q, L, generator=g) < 0.4, MIN)
        bias[..., -1] = 0.0  # every row sees a key
        torch.testing.assert_close(ops.attention(q, k, v, bias, 0.125), _sdpa(q, k, v, bias, R // Q, 0.125),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{R} rows: {m}")


def test_a_key_hidden_by_the_bias_weighs_exactly_nothing(ops):
    """A dtype-min bias must hide a key exactly: the values behind it never leak in, however large."""
    k, v = torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)
    v[:, :, 3] = 1e30
    bias = torch.zeros(1, 1, 1, 8)
    bias[..., 3] = MIN
    out = ops.attention(torch.randn(1, 1, 3, 64), k, v, bias, 0.125)
    assert torch.isfinite(out).all() and out.abs().max() < 10


def test_bad_shapes_name_the_problem(ops):
    q, k = torch.randn(1, 1, 3, 64), torch.randn(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="rows per head"):
        ops.attention(torch.randn(1, 1, kernels.ATTENTION_ROWS + 1, 64), k, k, None, 1.0)
    with pytest.raises(RuntimeError, match="bias"):
        ops.attention(q, k, k, torch.zeros(1, 1, 1, 7), 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.attention(q, k, k, torch.zeros(1, 1, 2, 8), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.attention(q.double(), k.double(), k.double(), None, 1.0)


def _points(monkeypatch, points):
    """The attention kernel's verdicts per (rows, keys) point (None: uncalibrated), as if its self-check
    had chosen them for the default variant."""
    routes = state.Routes(state.uncalibrated(True).linear, True, points)
    monkeypatch.setitem(state.CALIBRATED, kernels.variant(), routes)


def test_the_route_leaves_what_it_does_not_take_to_sdpa(ops, monkeypatch):
    _points(monkeypatch, None)
    q, k = torch.randn(1, 1, 3, 64), torch.randn(1, 1, 8, 64)
    assert kernels.attention(q, k, k, None, 0.125) is not None
    assert kernels.attention(q.double(), k.double(), k.double(), None, 0.125) is None
    assert kernels.attention(torch.randn(1, 1, kernels.ATTENTION_ROWS + 1, 64), k, k, None, 0.125) is None
    assert kernels.attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), k, None, 0.125) is None
    assert kernels.attention(q, k, k, torch.zeros(1, 1, 2, 8), 0.125) is None  # 3 rows, 2 bias rows
    _points(monkeypatch, {(3, 256): False})
    assert kernels.attention(q, k, k, None, 0.125) is None  # the self-check found SDPA faster there
    _points(monkeypatch, None)
    with use(RuntimeConfig(attention="sdpa")):
        assert kernels.attention(q, k, k, None, 0.125) is None


def test_calls_take_the_verdict_of_the_nearest_point():
    assert attn.attention_point(3, 300) == (3, 256)
    assert attn.attention_point(9, 300) == (12, 256)
    assert attn.attention_point(9, 900) == (12, 2048)  # nearer 2048 than 256 on a log scale
    assert attn.attention_point(60, 50_000) == (48, 2048)


def test_the_self_check_weighs_every_point(ops):
    points = calibrate.calibrate_attention(ops, torch.Generator().manual_seed(0), rounds=1, stream_mb=1)
    rows, keys = kernels.ATTENTION_POINTS
    assert set(points) == {(r, k) for r in rows for k in keys}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("drafter", ["perturbed", "prompt-lookup"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decoding_through_the_attention_kernel_stays_exact(seed, drafter, batch, ops, monkeypatch):
    """fp32 targets (head size 16) attend through the kernel at every block: plain steps, verifies of
    partly accepted drafts, ragged batches; every row equals the target's own greedy decoding."""
    _points(monkeypatch, None)  # uncalibrated: the kernel wherever it applies
    calls = {"kernel": 0}
    real = attn.attention_op  # asked by attention.attention, and once a forward by the lean path

    def counted(*args):
        out = real(*args)
        calls["kernel"] += out is not None
        return out

    monkeypatch.setattr(attn, "attention_op", counted)
    target = tiny_llama(seed, dtype=torch.float32)
    if not ops.attention_supports(target.config.hidden_size // target.config.num_attention_heads):
        pytest.skip("no kernel shape for the tiny model's head size here")
    d = ModelDrafter(perturbed(target, 0.3, seed)) if drafter == "perturbed" else PromptLookupDrafter()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (1, 6 + 5 * b), generator=g).repeat(1, 2) for b in range(batch)]
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(initial=6, maximum=6, adaptive=False, cost_aware=False),
                               runtime=RuntimeConfig(calibrate=False))  # these routes, not this machine's
    out = SpecDecoder(target, d, config).generate([p[0] for p in prompts], max_new_tokens=30, eos_token_id=None)
    for s, p in enumerate(prompts):
        assert torch.equal(out.generated(s), hf_greedy(target, p, 30)[0, p.shape[1]:]), f"sequence {s}"
    assert calls["kernel"], "the attention kernel never ran"
