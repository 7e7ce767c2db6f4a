"""The fused layer ops (csrc/layer_ops.cpp) against HF's own ops, and the lean forward through them.

fp32 targets take them (the float64 tiny models of most tests run HF's ops one by one): each op
against the formula it replaces (the rotary embedding bit for bit), the path's logits against the
unfused path's on chains, trees and ragged batches, and decoding through it token for token as the
target's own greedy decoding, with drafts accepted in part.
"""

import dataclasses
import platform

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import hf_greedy, perturbed, ragged_blocks, tiny_llama
from specdec.config import RuntimeConfig
from specdec import fastpath
from specdec.one_call import OneCall
from specdec.patch import skinny_linears
from specdec.runtime.build import extension
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters import ModelDrafter, PromptLookupDrafter


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 5, 64), (1, 3, 70)])  # 70: a tail past the vectors
def test_norms_match_hf_rmsnorm(ops, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x, d, w = torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), _rms(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    s, h = ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d)
    torch.testing.assert_close(h, _rms(x + d, w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B,Q,hq,hkv,D,cos_batch", [(1, 1, 9, 3, 64, 1), (2, 7, 4, 2, 16, 2), (3, 4, 4, 2, 16, 1)])
def test_rope_split_is_hf_rotary_bit_for_bit(ops, B, Q, hq, hkv, D, cos_batch):
    g = torch.Generator().manual_seed(B * Q + D)
    qkv = torch.randn(B, Q, (hq + 2 * hkv) * D, generator=g)
    cos, sin = torch.randn(cos_batch, Q, D, generator=g), torch.randn(cos_batch, Q, D, generator=g)
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    q, k, v = (t.view(B, Q, -1, D).transpose(1, 2) for t in (q, k, v))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k, got_v = ops.rope_split(qkv, cos, sin, hq, hkv)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_v.is_contiguous()


@pytest.mark.parametrize("shape", [(1, 1, 3072), (2, 3, 256), (1, 2, 70)])
def test_silu_mul_matches_torch(ops, shape):
    gu = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 6
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_a_prompts_rows_split_over_threads_are_each_rows_own(ops):
    """Blocks big enough to split by rows over two threads (a prompt's; 70 rows, so the chunks are uneven): every
    op's row is bit-equal to that row computed alone on one thread."""
    g = torch.Generator().manual_seed(7)
    B, Q, hq, hkv, D, C, I = 2, 70, 9, 3, 64, 576, 1536
    x, d, w = torch.randn(B, Q, C, generator=g), torch.randn(B, Q, C, generator=g), torch.randn(C, generator=g)
    gu = torch.randn(B, Q, 2 * I, generator=g) * 6
    qkv = torch.randn(B, Q, (hq + 2 * hkv) * D, generator=g)
    cos, sin = torch.randn(B, Q, D, generator=g), torch.randn(B, Q, D, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        norm, (total, added), silu, heads = (ops.rms_norm(x, w, 1e-6), ops.add_rms_norm(x, d, w, 1e-5),
                                            ops.silu_mul(gu), ops.rope_split(qkv, cos, sin, hq, hkv))
        torch.set_num_threads(1)
        for b in range(B):
            for t in range(Q):
                one = (slice(b, b + 1), slice(t, t + 1))
                assert torch.equal(norm[b, t], ops.rms_norm(x[one].clone(), w, 1e-6)[0, 0]), ("rms_norm", b, t)
                s, h = ops.add_rms_norm(x[one].clone(), d[one].clone(), w, 1e-5)
                assert torch.equal(total[b, t], s[0, 0]) and torch.equal(added[b, t], h[0, 0]), ("add_rms_norm", b, t)
                assert torch.equal(silu[b, t], ops.silu_mul(gu[one].clone())[0, 0]), ("silu_mul", b, t)
                alone = ops.rope_split(qkv[one].clone(), cos[one].clone(), sin[one].clone(), hq, hkv)
                for name, got, want in zip("qkv", heads, alone):
                    assert torch.equal(got[b, :, t], want[0, :, 0]), ("rope_split", name, b, t)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("variant", ["native", "avx2"] if platform.machine() in ("x86_64", "AMD64") else ["native"])
def test_argmax_rows_is_torchs_first_maximum_on_ties_infinities_and_nans(variant):
    """The op's index is torch.max(-1).indices on 4,000 random rows, both builds: ties (a few integer values,
    so most rows hold several maxima), signed zeros, infinities, NaNs (torch's max propagates the first), rows
    shorter and longer than four vectors with a tail, and the 49k-token rows of a verify; a row count of 0 and
    leading dims kept."""
    ops = extension(RuntimeConfig(kernel=variant))
    if ops is None:
        pytest.skip(f"the {variant} kernel is not built here")
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    for case in range(4000):
        V = [1, 3, 16, 17, 40, 64, 71, 49152][case % 8] if case % 50 else 49152
        x = torch.randint(-3, 3, (case % 3 + 1, V), generator=g).float()
        if case % 4 == 0:
            x = torch.randn(x.shape, generator=g)
        if case % 5 == 1:  # sprinkle specials
            n = torch.randint(1, 4, (), generator=g).item()
            idx = torch.randint(0, x.numel(), (n,), generator=g)
            x.view(-1)[idx] = specials[torch.randint(0, 5, (n,), generator=g)]
        assert torch.equal(ops.argmax_rows(x), x.max(-1).indices), (case, x)
    x = torch.randn(2, 3, 40, generator=g)
    assert torch.equal(ops.argmax_rows(x), x.max(-1).indices) and ops.argmax_rows(x[:0]).shape == (0, 3)
    with pytest.raises(RuntimeError, match="argmax_rows: rows of at least one value"):
        ops.argmax_rows(torch.randn(2, 0))


@pytest.mark.parametrize("variant", ["native", "avx2"] if platform.machine() in ("x86_64", "AMD64") else ["native"])
def test_mask_rows_is_masked_fill_over_the_unpacked_bitmask(variant):
    """mask_rows_ (a constrained row's -inf where the grammar's packed bitmask forbids) equals masked_fill over
    unpack_bitmask's bools on seeded random words (sign bits, bits past V, rows allowing nothing or one token),
    V a multiple of the vector or not, both builds; in place; bad shapes named."""
    from specdec.processing.grammar import unpack_bitmask

    ops = extension(RuntimeConfig(kernel=variant))
    if ops is None:
        pytest.skip(f"the {variant} kernel is not built here")
    g = torch.Generator().manual_seed(0)
    for case in range(400):
        V = [1, 7, 16, 31, 32, 33, 150, 49152][case % 8]
        R = case % 5 + 1
        bits = torch.randint(-2**31, 2**31 - 1, (R, -(-V // 32)), dtype=torch.int32, generator=g)
        if case % 3 == 0:  # one allowed token (a forced row)
            bits.zero_()
            t = int(torch.randint(0, V, (), generator=g))
            bits[:, t // 32] = 1 << (t % 32) if t % 32 != 31 else -2**31
        x = torch.randn(R, V, generator=g)
        want = x.masked_fill(~unpack_bitmask(bits, V), float("-inf"))
        out = ops.mask_rows_(x, bits)
        assert out.data_ptr() == x.data_ptr() and torch.equal(x, want), (case, V, R)
    with pytest.raises(RuntimeError, match="mask_rows_: x \\[R, V\\] float32"):
        ops.mask_rows_(torch.randn(2, 40), torch.zeros(2, 1, dtype=torch.int32))


def test_bad_shapes_are_named(ops):
    with pytest.raises(RuntimeError, match="rope_split: qkv"):
        ops.rope_split(torch.randn(1, 2, 100), torch.randn(1, 2, 16), torch.randn(1, 2, 16), 4, 2)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul: an odd"):
        ops.silu_mul(torch.randn(2, 7))


def _blocks(model, fuse: bool):
    fastpath.get(model).fuse = fuse
    return ragged_blocks(model)


def _fused_ops_made(monkeypatch, change=None) -> dict:
    """Count the forwards that take the fused layer ops (``change``: what to make of those ops)."""
    calls = {"n": 0}
    real = fastpath.FastPath._fused_ops

    def counted(self, *args):
        ops = real(self, *args)
        calls["n"] += ops is not None
        return ops if ops is None or change is None else change(ops)

    monkeypatch.setattr(fastpath.FastPath, "_fused_ops", counted)
    return calls


def test_fused_path_matches_the_unfused_one(ops, monkeypatch):
    calls = _fused_ops_made(monkeypatch)
    model = tiny_llama(3, dtype=torch.float32)
    assert fastpath.get(model) is not None  # built and checked against HF's forward (through the fused ops)
    calls["n"] = 0
    fused, plain = _blocks(model, True), _blocks(model, False)
    assert calls["n"] == 3, "the fused layers did not run for every fp32 block"
    for (lf, hf_), (lp, hp) in zip(fused, plain):
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hf_, hp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", [1, 3])
def test_decoding_through_the_fused_ops_is_exact(ops, seed, batch):
    """fp32 targets, drafts accepted in part (a perturbed copy, prompt lookup), ragged batches: every row
    equals the target's own greedy decoding (HF's generate, HF's ops)."""
    target = tiny_llama(seed, dtype=torch.float32)
    assert fastpath.get(target).fuse and fastpath.get(target)._fused_ops(torch.zeros(1, 1, 64),
                                                                          torch.zeros(1, 1, 16)) is not None
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (1, 5 + 4 * b), generator=g).repeat(1, 2) for b in range(batch)]
    drafter = ModelDrafter(perturbed(target, 0.3, seed)) if seed % 2 else PromptLookupDrafter()
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(initial=5, maximum=5, adaptive=False, cost_aware=False))
    out = SpecDecoder(target, drafter, config).generate([p[0] for p in prompts], max_new_tokens=30, eos_token_id=None)
    for s, p in enumerate(prompts):
        assert torch.equal(out.generated(s), hf_greedy(target, p, 30)[0, p.shape[1]:]), f"sequence {s}"
    assert out.mean_accepted_tokens > 1.0, "no draft was accepted: the test would not see a verify"


@pytest.mark.parametrize("kind", ["streaming", "snapkv"])
@pytest.mark.parametrize("seed", [0, 1])
def test_self_speculation_through_the_fused_ops_is_exact(ops, kind, seed):
    """The drafter runs the target's own layers over a compressed cache (fewer keys than the target's
    store): through the fused ops and the directly called attention kernel too, still exact."""
    from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter

    target = tiny_llama(seed, dtype=torch.float32)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
    drafter = (StreamingDrafter(target, budget=12, sink=4, overshoot=8) if kind == "streaming"
               else SnapKVDrafter(target, budget=12, window=8, kernel=3, overshoot=8))
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(initial=4, maximum=4, adaptive=False, cost_aware=False))
    out = SpecDecoder(target, drafter, config).generate(ids, max_new_tokens=30)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 30))
    drafted = [s for s in out.steps if s.num_drafted[0]]
    assert any(0 < s.num_accepted[0] < s.num_drafted[0] for s in drafted), "no draft was accepted in part"


def test_fused_ops_that_disagree_are_dropped_not_the_path(ops, monkeypatch, caplog):
    """The build-time check runs through the fused ops: if they disagree with HF's forward (here: made
    to return junk), the path is kept without them, a warning says so, and decoding stays exact."""
    import logging

    _fused_ops_made(monkeypatch, lambda ops: dataclasses.replace(ops, silu_mul=lambda gu: ops.silu_mul(gu) * 1.5))
    target = tiny_llama(5, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="specdec.fastpath"):
        path = fastpath.get(target)
    assert path is not None and not path.fuse
    assert "fused layer ops disagree" in caplog.text
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(5)).repeat(1, 2)
    out = SpecDecoder(target, PromptLookupDrafter()).generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))


def test_a_fused_op_that_fails_leaves_hf_ops(ops, monkeypatch, caplog):
    import logging

    def fails(*a):
        raise RuntimeError("rope_split: qkv does not hold the heads")

    _fused_ops_made(monkeypatch, lambda ops: dataclasses.replace(ops, rope_split=fails))
    target = tiny_llama(6, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="specdec.fastpath"):
        path = fastpath.get(target)
    assert path is not None and not path.fuse
    assert "lean forward failed" in caplog.text and "rope_split" in caplog.text


def _count_one_calls(monkeypatch) -> dict:
    calls = {"ran": 0, "declined": 0}
    real = OneCall.__call__

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["ran" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(OneCall, "__call__", counted)
    return calls


@pytest.mark.parametrize("kernel_routes,attention", [(False, "kernel"), (True, "kernel"), (False, "sdpa")])
def test_one_call_is_the_loop_bit_for_bit(ops, monkeypatch, kernel_routes, attention):
    """All layers in one compiled call (csrc/layers.cpp) give the loop's logits and hidden states exactly,
    through torch's linears and through the kernels' routes, on a chain, a ragged tree block and a SPLIT
    block (each batch row attending over its own rows); with SDPA's attention too (where the self-check
    finds it faster, or RuntimeConfig(attention="sdpa"): SDPA over the grouped rows, as grouped_attention calls it)."""
    from specdec.runtime import kernels

    runtime = RuntimeConfig(attention=attention if attention == "sdpa" else "auto")
    model = tiny_llama(3, dtype=torch.float32)
    path = fastpath.get(model, runtime)
    calls = _count_one_calls(monkeypatch)
    outs = {}
    for one_call in (True, False):
        path.one_call = one_call
        with skinny_linears(model, max_rows=kernels.MAX_ROWS if kernel_routes else 0, runtime=runtime):
            outs[one_call] = ragged_blocks(model)
    # the first block fills a store with no buffers yet (its update makes them): declined; the others ran
    assert calls == {"ran": 2, "declined": 1}
    for (la, ha), (lb, hb) in zip(outs[True], outs[False]):
        assert torch.equal(la, lb) and torch.equal(ha, hb)


def test_one_call_keeps_the_named_layers_inputs_as_the_loop_does(ops, monkeypatch):
    """EAGLE-3's features (the residual stream entering named layers, the embeddings for layer 0) from the
    one compiled call equal the loop's bit for bit, on a chain, a ragged tree block and a SPLIT block."""
    model = tiny_llama(3, dtype=torch.float32)
    path = fastpath.get(model)
    calls = _count_one_calls(monkeypatch)
    outs = {}
    for one_call in (True, False):
        path.one_call = one_call
        outs[one_call] = ragged_blocks(model, layers=(1, 0))
    assert calls == {"ran": 2, "declined": 1}
    for (la, ha), (lb, hb) in zip(outs[True], outs[False]):
        assert ha.shape[-1] == 2 * model.config.hidden_size
        assert torch.equal(la, lb) and torch.equal(ha, hb)


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_one_call_random_blocks_and_commits_are_the_loops(ops, monkeypatch, attention):
    """Seeded property test: random batches (1-4 rows, ragged lengths), random trees and chains of 1-6
    rows, PAD and SPLIT attention, BMC periods 1-16, random accepted paths: two stores, one fed by the
    one call and one by the loop, give the same logits and hold the same K/V after every block, bit for
    bit."""
    runtime = RuntimeConfig(attention=attention if attention == "sdpa" else "auto")
    from specdec.runtime import kernels
    from specdec.forward import forward_block
    from specdec.kv.bmc import BMCCache, BMCConfig
    from specdec.tree import ancestor_mask

    model = tiny_llama(4, dtype=torch.float32)
    path = fastpath.get(model, runtime)
    calls = _count_one_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    rand = lambda n: int(torch.randint(n, (1,), generator=g))  # noqa: E731
    with skinny_linears(model, runtime=runtime):
        for case in range(150):
            B, T = 1 + rand(4), [1, 2, 3, 8, 16][rand(5)]
            caches = {m: BMCCache.for_model(model, B, BMCConfig(T)) for m in (True, False)}
            prompt = torch.randint(1, V, (B, 3 + rand(6)), generator=g)
            for step in range(4):
                Q = 1 + rand(6)
                ids = torch.randint(1, V, (B, Q), generator=g)
                chain = step == 0 or rand(2) == 0
                if not chain:  # a random tree per row under the pending token: node j's parent is -1 (the
                    # pending token) or an earlier node
                    parents = torch.stack([torch.tensor([rand(j + 1) - 1 for j in range(Q - 1)], dtype=torch.long)
                                           for _ in range(B)])
                    mask = ancestor_mask(parents)
                    depth = mask.sum(-1) - 1
                split = B > 1 and rand(2) == 1  # SPLIT attention: each row over its own rows
                outs = {}
                for one_call, cache in caches.items():
                    path.one_call = one_call
                    block = prompt if step == 0 else ids
                    outs[one_call] = (forward_block(model, cache, block, None, None, split=split) if chain
                                      else forward_block(model, cache, block, mask, depth, split=split))
                assert torch.equal(outs[True].logits, outs[False].logits), f"case {case} step {step}"
                q = (prompt if step == 0 else ids).shape[1]
                if chain:
                    keep = [list(range(1 + rand(q))) for _ in range(B)]
                else:  # the pending token and the path down to a random node of each row's tree
                    keep = []
                    for b in range(B):
                        node, rows = rand(q) - 1, []
                        while node >= 0:
                            rows.append(1 + node)
                            node = int(parents[b, node])
                        keep.append([0] + rows[::-1])
                for cache in caches.values():
                    cache.commit(keep)
                a, b_ = caches[True], caches[False]
                assert a.lengths == b_.lengths
                for la, lb in zip(a.layers, b_.layers):
                    for b in range(B):
                        n = a.lengths[b]
                        assert torch.equal(la.keys[b, :, :n], lb.keys[b, :, :n])
                        assert torch.equal(la.values[b, :, :n], lb.values[b, :, :n])
    assert calls["ran"] >= 400, calls  # every block after a case's first went through the one call


def test_the_layers_op_names_bad_arguments(ops):
    x = torch.randn(1, 1, 64)
    k = torch.zeros(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="per layer 4 weights"):
        ops.layers(x, x, [torch.randn(64, 64)], [], [None], [x[0, 0]] * 2, [1e-5] * 2, [k], [k], [0],
                   torch.ones(1, 1, 16), torch.zeros(1, 1, 16), None, 2, 1, 0.25, [0, 1, 0], [True])
    with pytest.raises(RuntimeError, match="1 starts for a batch of 2|starts for a batch"):
        x2 = torch.randn(2, 1, 64)
        ops.layers(x2, x2, [torch.randn(64, 64)] * 4, [], [None] * 4, [x[0, 0]] * 2, [1e-5] * 2, [k], [k], [0],
                   torch.ones(1, 1, 16), torch.zeros(1, 1, 16), None, 2, 1, 0.25, [0, 2, 0], [True])
    with pytest.raises(RuntimeError, match="route 7"):
        ops.layers(x, x, [torch.randn(64, 64)] * 4, [], [None] * 4, [x[0, 0]] * 2, [1e-5] * 2, [k], [k], [0],
                   torch.ones(1, 1, 16), torch.zeros(1, 1, 16), None, 2, 1, 0.25, [0, 1, 7], [True])
    with pytest.raises(RuntimeError, match="1 attention routes for 2 rows"):
        x2 = torch.randn(2, 1, 64)
        k2 = torch.zeros(2, 2, 8, 16)
        ops.layers(x2, x2, [torch.randn(64, 64)] * 4, [], [None] * 4, [x[0, 0]] * 2, [1e-5] * 2, [k2], [k2], [0, 3],
                   torch.ones(1, 1, 16), torch.zeros(1, 1, 16), None, 2, 1, 0.25, [0, 2, 0], [True], True)
