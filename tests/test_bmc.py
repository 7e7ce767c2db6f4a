"""The BMC store against transformers' DynamicCache, its growth policy, and its commit moves."""

import math

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama
from specdec.forward import cache_arg, forward_block
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.tree import ancestor_mask, chain_mask


def _chain_forward(model, cache, ids):
    B, Q = ids.shape
    return forward_block(model, cache, ids, chain_mask(B, Q), torch.arange(Q).expand(B, Q))


@pytest.mark.parametrize("period", [1, 5, 64])
def test_logits_match_dynamic_cache_float32(period):
    """Prefill then 1-, 3- and 1-token blocks: same logits as a DynamicCache run (fp32, atol 1e-5)."""
    model = tiny_llama(3, dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 41))
    ref_cache = DynamicCache(config=model.config)
    bmc = BMCCache.for_model(model, 1, BMCConfig(period))
    pos = 0
    for q in [17, 1, 3, 1, 7, 1, 11]:
        block = ids[:, pos : pos + q]
        with torch.no_grad():
            ref = model(block, use_cache=True, **{cache_arg(model): ref_cache}).logits
        ours = _chain_forward(model, bmc, block).logits
        bmc.commit([list(range(q))])
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        pos += q
    assert bmc.lengths == [pos]


@pytest.mark.parametrize("period,n", [(1, 50), (8, 50), (16, 64), (64, 100), (128, 300)])
def test_allocations_are_ceil_n_over_t(period, n):
    """One reallocation every T tokens, not one per token: ceil(N / T) over N one-token steps."""
    model = tiny_llama(0)
    cache = BMCCache.for_model(model, 1, BMCConfig(period))
    for t in torch.randint(0, 128, (n,)).tolist():
        _chain_forward(model, cache, torch.tensor([[t]]))
        cache.commit([[0]])
    assert cache.num_allocations == math.ceil(n / period)
    assert cache.capacity == math.ceil(n / period) * period


def test_rejected_rows_become_padding_and_are_overwritten():
    """Write 4 draft rows, keep 2: the next forward sees exactly the committed text."""
    model = tiny_llama(1)
    text = torch.randint(0, 128, (1, 30))
    cache = BMCCache.for_model(model, 1, BMCConfig(4))
    _chain_forward(model, cache, text[:, :20])
    cache.commit([list(range(20))])
    junk = torch.randint(0, 128, (1, 4))
    block = torch.cat([text[:, 20:22], junk[:, :2]], dim=1)
    _chain_forward(model, cache, block)
    cache.commit([[0, 1]])  # rows 22, 23 (junk) are padding now
    ours = _chain_forward(model, cache, text[:, 22:30]).logits
    with torch.no_grad():
        ref = model(text[:, :30]).logits[:, 22:30]
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)


def test_commit_gathers_a_tree_path_into_place():
    """Tree block [pending, a, x, b] with path a -> b (b's parent is a): keep rows 0, 1, 3."""
    model = tiny_llama(2)
    text = torch.randint(0, 128, (1, 16))
    cache = BMCCache.for_model(model, 1, BMCConfig(8))
    _chain_forward(model, cache, text[:, :10])
    cache.commit([list(range(10))])
    x = (text[0, 11] + 1) % 128
    block = torch.tensor([[text[0, 10], text[0, 11], x, text[0, 12]]])
    parents = torch.tensor([[-1, -1, 0]])  # nodes: a (row 1), x (row 2), b (row 3, child of a)
    mask = ancestor_mask(parents)
    depth = torch.tensor([[0, 1, 1, 2]])
    out = forward_block(model, cache, block, mask, depth)
    cache.commit([[0, 1, 3]])
    assert cache.lengths == [13]
    with torch.no_grad():
        ref_all = model(text[:, :16]).logits
    # tree logits at the path rows equal the plain causal logits at those positions
    torch.testing.assert_close(out.logits[:, [0, 1, 3]], ref_all[:, 10:13], atol=1e-10, rtol=1e-10)
    ours = _chain_forward(model, cache, text[:, 13:16]).logits
    torch.testing.assert_close(ours, ref_all[:, 13:16], atol=1e-10, rtol=1e-10)


def test_ragged_rows_each_keep_their_own_length():
    """Two rows with different committed lengths attend only to their own rows."""
    model = tiny_llama(4)
    a, b = torch.randint(0, 128, (1, 12)), torch.randint(0, 128, (1, 12))
    cache = BMCCache.for_model(model, 2, BMCConfig(4))
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0, :9], ids[1, :5] = a[0, :9], b[0, :5]
    _chain_forward(model, cache, ids)
    cache.commit([list(range(9)), list(range(5))])
    out = _chain_forward(model, cache, torch.stack([a[0, 9:11], b[0, 5:7]]))
    with torch.no_grad():
        ra = model(a[:, :11]).logits[:, 9:11]
        rb = model(b[:, :7]).logits[:, 5:7]
    torch.testing.assert_close(out.logits[0:1], ra, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.logits[1:2], rb, atol=1e-10, rtol=1e-10)


def test_rollback_refuses_to_grow():
    cache = BMCCache(2, 1)
    cache.lengths = [5]
    cache.rollback([3])
    assert cache.lengths == [3]
    with pytest.raises(AssertionError, match="cannot roll back"):
        cache.rollback([4])


def test_bad_period_is_an_error():
    with pytest.raises(ValueError, match="period T must be >= 1"):
        BMCConfig(0)


def test_period_chosen_at_each_reallocation_keeps_logits_exact():
    """A policy that picks a new T at every reallocation (as the decoder's period model does): the
    logits still match a DynamicCache run, and each growth rounds up to the T chosen then."""
    model = tiny_llama(4, dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 90))
    ref_cache = DynamicCache(config=model.config)
    bmc = BMCCache.for_model(model, 1, BMCConfig(3))
    periods = iter([5, 2, 16, 7, 1, 32, 4, 9, 64, 3] * 4)
    chosen = []
    bmc.period_policy = lambda held: chosen.append((held, next(periods))) or chosen[-1][1]
    pos = 0
    for q in [9, 1, 3, 1, 7, 1, 11, 2, 13, 5, 1, 17, 4, 6]:
        block = ids[:, pos : pos + q]
        with torch.no_grad():
            ref = model(block, use_cache=True, **{cache_arg(model): ref_cache}).logits
        before = bmc.capacity
        ours = _chain_forward(model, bmc, block).logits
        if bmc.capacity != before:
            held, T = chosen[-1]
            assert held == pos and bmc.capacity == math.ceil((pos + q) / T) * T
        bmc.commit([list(range(q))])
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        pos += q
    assert len(chosen) >= 8


def test_period_model_grows_t_with_the_sequence_and_caps_padding():
    from specdec.controller.period import PeriodCosts, PeriodModel, optimal_period

    costs = PeriodCosts(copy=2e-6, pad=1e-6)
    # the worked example: sqrt(2 x 512 x 2304 x 2) = 2172 -> 2048, capped at 2048 / 8 = 256
    assert optimal_period(512, 2048, costs) == 256
    assert optimal_period(512, 2048, costs, pad_share=1.0) == 2048
    # few rows still to come: the copies they cause are cheap, T falls below the cap
    assert optimal_period(8, 8192, costs) == 512 < optimal_period(512, 8192, costs) == 1024
    # dear copies ask for a bigger T, dear padding for a smaller one (cap lifted to see it)
    big = optimal_period(64, 1024, PeriodCosts(copy=8e-6, pad=1e-6), pad_share=1.0)
    small = optimal_period(64, 1024, PeriodCosts(copy=1e-6, pad=8e-6), pad_share=1.0)
    assert big == 1024 and small == 128
    model = PeriodModel(costs)
    ts = [model.period(n + 1024, n) for n in (100, 1000, 2000, 4000, 8000, 16000)]
    assert ts == sorted(ts) and ts[0] == 64 and ts[-1] == 1024  # never below 64; grows with the length
    with pytest.raises(ValueError, match="costs"):
        optimal_period(1, 1, PeriodCosts(copy=0.0, pad=1.0))


def test_direct_buffers_grow_to_hold_the_planned_block():
    """A forward that writes by itself (fastpath's one compiled call) gets every layer's buffers with room
    for the planned block (capacity a multiple of T, grown once for all layers) and the rows' starts;
    before the store has buffers it gets None (the layers' update makes them)."""
    cache = BMCCache(num_layers=3, batch_size=2, config=BMCConfig(4), dtype=torch.float32)
    cache.prepare_chain(5)
    assert cache.direct_buffers() is None
    k, v = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    for i in range(3):
        cache.layers[i].load_prefix(0, k, v, 8)
        cache.layers[i].load_prefix(1, k[:, :5], v[:, :5], 8)
    cache.lengths = [7, 5]
    cache.prepare_chain(3)  # ragged: rows 7-9 and 5-7, the view 10 rows
    keys, values, starts = cache.direct_buffers()
    assert starts == [7, 5] and len(keys) == len(values) == 3
    assert all(t.shape == (2, 2, 12, 16) and t.is_contiguous() for t in keys + values)  # 10 -> 12 (T = 4)
    assert torch.equal(keys[0][0, :, :7], k) and torch.equal(values[2][1, :, :5], v[:, :5])  # kept rows copied
    assert cache.num_allocations == 1  # counted once for the three layers


@pytest.mark.parametrize("period,n", [(1, 30), (8, 50)])
def test_allocations_are_ceil_n_over_t_through_the_one_call(period, n):
    """fp32 targets write through the lean forward's one compiled call: still one reallocation per T tokens."""
    from specdec.runtime import kernels

    if kernels.extension() is None:
        pytest.skip("no kernel on this machine")
    model = tiny_llama(0, dtype=torch.float32)
    cache = BMCCache.for_model(model, 1, BMCConfig(period))
    _chain_forward(model, cache, torch.tensor([[5]]))  # the first block makes the buffers (the layers' update)
    cache.commit([[0]])
    for t in torch.randint(0, 128, (n - 1,)).tolist():
        _chain_forward(model, cache, torch.tensor([[t]]))
        cache.commit([[0]])
    assert cache.num_allocations == math.ceil(n / period)
    assert cache.capacity == math.ceil(n / period) * period


# -- a server's batch: rows leave and join between steps ------------------------------------------

H, D, LAYERS = 2, 3, 2


def _kv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)


def _store(lengths: list[int], gen: torch.Generator, rows: list) -> BMCCache:
    """A store of len(lengths) rows prefilled with random K/V; appends each row's content to ``rows``."""
    cache = BMCCache(LAYERS, len(lengths), BMCConfig(4))
    for b, n in enumerate(lengths):
        kvs = [_kv(n, gen) for _ in range(LAYERS)]
        cache.load_prefill(b, kvs, max(lengths))
        rows.append([(k.clone(), v.clone()) for k, v in kvs])
    return cache


def _step(cache: BMCCache, gen: torch.Generator, rows: list) -> None:
    """One chain block of q rows per batch row; each row keeps a random prefix of it."""
    B, q = cache.batch_size, int(torch.randint(1, 4, (1,), generator=gen))
    cache.prepare_chain(q)
    blocks = [(torch.randn(B, H, q, D, generator=gen), torch.randn(B, H, q, D, generator=gen)) for _ in range(LAYERS)]
    for layer, (k, v) in zip(cache.layers, blocks):
        layer.update(k, v)
    kept = [int(torch.randint(1, q + 1, (1,), generator=gen)) for _ in range(B)]
    cache.commit([list(range(a)) for a in kept])
    for b, a in enumerate(kept):
        rows[b] = [(torch.cat([k0, k[b, :, :a]], 1), torch.cat([v0, v[b, :, :a]], 1))
                   for (k0, v0), (k, v) in zip(rows[b], blocks)]


def _check(cache: BMCCache, rows: list) -> None:
    assert cache.batch_size == len(rows)
    for b, row in enumerate(rows):
        n = cache.lengths[b]
        for layer, (k, v) in zip(cache.layers, row):
            assert n == k.shape[1]
            assert torch.equal(layer.keys[b, :, :n], k) and torch.equal(layer.values[b, :, :n], v)
    for layer in cache.layers:  # padding stays finite (a masked row still enters q.k^T)
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    assert cache.capacity <= 2 * (math.ceil(cache.max_length / cache.period) + 1) * cache.period + 3 * cache.period


@pytest.mark.parametrize("seed", range(40))
@torch.inference_mode()  # as the decoder runs it
def test_rows_leaving_and_joining_keep_every_rows_committed_kv(seed):
    """Random steps, leaves and joins against a plain list of each row's K/V: every live row holds
    exactly its own committed rows, in batch order, and the buffers never hold more than a shrink allows."""
    gen = torch.Generator().manual_seed(seed)
    rows: list = []
    cache = _store([int(x) for x in torch.randint(1, 12, (3,), generator=gen)], gen, rows)
    for _ in range(12):
        op = int(torch.randint(0, 3, (1,), generator=gen))
        if op == 0:
            _step(cache, gen, rows)
        elif op == 1 and cache.batch_size > 1:
            keep = sorted(torch.randperm(cache.batch_size, generator=gen)[: max(1, cache.batch_size // 2)].tolist())
            cache.select(keep)
            rows[:] = [rows[b] for b in keep]
        else:
            joined: list = []
            other = _store([int(x) for x in torch.randint(1, 30, (int(torch.randint(1, 3, (1,), generator=gen)),),
                                                         generator=gen)], gen, joined)
            if torch.rand(1, generator=gen) < 0.5:
                _step(other, gen, joined)
            cache.append(other)
            rows += joined
        _check(cache, rows)


@torch.inference_mode()
def test_a_join_that_fits_reuses_the_buffers_and_a_long_rows_leaving_shrinks_them():
    gen = torch.Generator().manual_seed(0)
    rows: list = []
    cache = _store([5, 6, 7], gen, rows)
    cache.select([0, 2])  # a row leaves: room for one
    rows[:] = [rows[0], rows[2]]
    for layer in cache.layers:  # a spare row as a fresh buffer may hold it: never written, any bits
        for buffer in layer._room_kv:
            buffer[2:] = float("nan")
    buffer = cache.layers[0].keys.data_ptr()
    joined: list = []
    cache.append(_store([3], gen, joined))
    rows += joined
    assert cache.layers[0].keys.data_ptr() == buffer and cache.batch_size == 3
    _check(cache, rows)
    long: list = []
    cache.append(_store([200], gen, long))  # past the room and the capacity: new buffers
    rows += long
    assert cache.layers[0].keys.data_ptr() != buffer and cache.capacity >= 200
    cache.select([0, 1, 2])
    rows[:] = rows[:3]
    assert cache.capacity <= 2 * (math.ceil(cache.max_length / cache.period) + 1) * cache.period
    _check(cache, rows)
