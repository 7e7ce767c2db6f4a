"""The prefix cache: the block index on token lists (match, insert, LRU eviction of leaves under a byte
budget), the aligned prefill bit for bit with and without a reused prefix (and right: against HF's
forward, and shown to notice a prefix one position off), and whole generations with a cache equal to
generations without, alone, in a batch, with drafters (prompt lookup, a model, self-speculation)."""

import pytest
import torch

from conftest import hf_greedy, perturbed, tiny_llama
from specdec import PrefixCache, PromptLookupDrafter, SpecDecoder
from specdec.config import RuntimeConfig
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters import ModelDrafter
from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
from specdec.forward import prefill_aligned
from specdec.kv.bmc import BMCConfig
from specdec.kv.prefix import BlockIndex

TARGET = tiny_llama(5, layers=2)  # float64, 4 query heads, 2 K/V heads
BLOCK = 8
MB = 2**20


def _ids(seed: int, length: int) -> list[int]:
    return torch.randint(1, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(k: int = 4) -> SpecDecoderConfig:
    return SpecDecoderConfig(bmc=BMCConfig(16), adaptive_period=False,
                             draft_length=DraftLengthConfig(initial=k, maximum=max(k, 8), cost_aware=False))


# -- the index, on token lists ---------------------------------------------------------------------

def test_match_walks_whole_blocks_and_stops_at_the_first_difference():
    index = BlockIndex(2, 1000)
    index.insert([1, 2, 3, 4, 5], 10, lambda i: i)  # blocks (1,2) (3,4); 5 is no whole block
    assert len(index) == 2 and index.nbytes == 20
    assert len(index.match([1, 2, 3, 4, 9])) == 2
    assert len(index.match([1, 2, 7, 7])) == 1
    assert index.match([2, 1]) == []
    assert len(index.match([1, 2, 3, 4], limit=1)) == 1
    assert [index.payload(n) for n in index.match([1, 2, 3, 4])] == [0, 1]


def test_the_same_tokens_after_another_prefix_are_another_block():
    index = BlockIndex(2, 1000)
    index.insert([1, 2, 3, 4], 1, lambda i: ("a", i))
    index.insert([9, 9, 3, 4], 1, lambda i: ("b", i))
    assert len(index) == 4
    assert [index.payload(n) for n in index.match([9, 9, 3, 4])] == [("b", 0), ("b", 1)]
    assert index.match([3, 4]) == []  # (3, 4) only ever came second


def test_insert_touches_held_blocks_and_makes_only_the_missing_ones():
    made = []
    index = BlockIndex(2, 1000)
    index.insert([1, 2, 3, 4], 1, made.append)
    index.insert([1, 2, 3, 4, 5, 6], 1, made.append)
    assert made == [0, 1, 2] and len(index) == 3


def test_eviction_takes_the_least_recently_used_leaf_first():
    index = BlockIndex(2, 3)  # room for three blocks of 1 byte
    index.insert([1, 2, 3, 4], 1, lambda i: i)  # a chain of two
    index.insert([5, 6], 1, lambda i: i)  # a third root
    index.match([1, 2, 3, 4])  # the chain is the most recent now
    index.insert([7, 8], 1, lambda i: i)  # evicts (5, 6): the least recently used leaf
    assert index.match([5, 6]) == [] and len(index.match([1, 2, 3, 4])) == 2
    assert index.evictions == 1 and index.nbytes == 3


def test_a_parent_outlives_its_children():
    index = BlockIndex(2, 2)
    index.insert([1, 2, 3, 4], 1, lambda i: i)  # parent (1,2) is older than its child (3,4)
    index.insert([5, 6], 1, lambda i: i)  # the only leaf is the child: it goes, the parent stays
    assert len(index.match([1, 2, 3, 4])) == 1 and len(index.match([5, 6])) == 1


def test_a_chain_never_evicts_its_own_blocks_and_stops_when_full():
    index = BlockIndex(2, 2)
    ids = index.insert([1, 2, 3, 4, 5, 6], 1, lambda i: i)
    assert len(ids) == 2 and len(index.match([1, 2, 3, 4, 5, 6])) == 2
    assert BlockIndex(2, 0).insert([1, 2], 1, lambda i: i) == []  # no budget: nothing kept


def test_reusable_rows_stop_at_whole_blocks_before_the_last_token():
    cache = PrefixCache(MB, block=4)
    assert [cache.reusable(n) for n in (1, 3, 4, 5, 8, 9)] == [0, 0, 0, 4, 4, 8]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block >= 1"):
        PrefixCache(MB, block=0)
    with pytest.raises(ValueError, match="max_bytes >= 0"):
        PrefixCache(-1)


# -- the aligned prefill: bits with and without a reused prefix -------------------------------------

def _layers_equal(a, b) -> bool:
    return all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b))


TARGET32 = tiny_llama(5, layers=2, dtype=torch.float32)  # fp32: the CPU kernels' routes and fused ops take it
PATHS = {"lean": RuntimeConfig(calibrate=False), "hf": RuntimeConfig(calibrate=False, fastpath=False)}


@pytest.mark.parametrize("length", [9, 24, 37])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("target", [TARGET, TARGET32], ids=["float64", "float32"])
def test_a_reused_prefix_gives_the_bits_of_no_reuse(length, path, target):
    ids = torch.tensor(_ids(length, length))
    with SpecDecoder(target, config=SpecDecoderConfig(runtime=PATHS[path])).running():
        cold = prefill_aligned(target, ids, BLOCK)
        for n in range(BLOCK, length, BLOCK):  # every whole-block prefix short of the last token
            hit = [(k[0, :, :n], v[0, :, :n]) for k, v in cold.layers]
            warm = prefill_aligned(target, ids, BLOCK, hit)
            assert torch.equal(warm.logits, cold.logits), f"prefix {n}"
            assert _layers_equal(warm.layers, cold.layers), f"prefix {n}"


def test_the_aligned_prefill_is_the_models_forward():
    """The same logits as HF's forward of the whole prompt (to summation order): positions and rotary
    of every chunk are right, which bit-equality between two runs of one path could not show."""
    ids = torch.tensor(_ids(1, 30))
    with torch.no_grad():
        ref = TARGET(ids[None]).logits[0, -1]
    out = prefill_aligned(TARGET, ids, BLOCK, [(k[0, :, :16], v[0, :, :16])
                                                for k, v in prefill_aligned(TARGET, ids, BLOCK).layers])
    torch.testing.assert_close(out.logits[0], ref, rtol=0, atol=1e-10)


def test_rows_one_position_off_change_the_answer():
    """What the bit checks above would catch: the same tokens' rows computed one position later (a
    prompt with one more token in front) are other rows, and give other logits."""
    ids = _ids(2, 25)
    cold = prefill_aligned(TARGET, torch.tensor(ids), BLOCK)
    shifted = prefill_aligned(TARGET, torch.tensor([7] + ids), BLOCK)  # ids[i] at position i + 1
    off = [(k[0, :, 1 : 1 + 16], v[0, :, 1 : 1 + 16]) for k, v in shifted.layers]
    warm = prefill_aligned(TARGET, torch.tensor(ids), BLOCK, off)
    assert not torch.equal(warm.logits, cold.logits)
    assert (warm.logits - cold.logits).abs().max() > 1e-6


# -- whole generations ----------------------------------------------------------------------------

SYSTEM = _ids(10, 40)  # a shared "system prompt": 5 whole blocks
PROMPTS = [SYSTEM + _ids(11, 6), SYSTEM + _ids(12, 13), SYSTEM[:21] + _ids(13, 9),  # 2 blocks + 5 tokens shared
           SYSTEM + _ids(11, 6) + _ids(14, 20), SYSTEM[:16], _ids(15, 12)]  # a longer turn; an exact prefix; none

DRAFTERS = {
    "none": lambda: None,
    "prompt-lookup": lambda: PromptLookupDrafter(),
    "model": lambda: ModelDrafter(perturbed(TARGET, 0.3)),  # part of each draft accepted
}


def _expected(prompts, max_new: int) -> list[list[int]]:
    return [hf_greedy(TARGET, torch.tensor(p)[None], max_new)[0, len(p):].tolist() for p in prompts]


def _answers(out) -> list[list[int]]:
    return [out.generated(b).tolist() for b in range(len(out.num_new))]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_alone_each_prompt_answers_as_without_the_cache(name):
    """Tokens equal to HF's and to a decoder without a cache; every logprob bit-equal to a decoder whose
    cache keeps nothing (the same aligned prefill, computed whole): a row off by one position moves them
    even where the tiny model's argmax does not move."""
    cache = PrefixCache(MB, block=BLOCK)
    with_cache = SpecDecoder(TARGET, DRAFTERS[name](), _config(), prefix_cache=cache)
    cold = SpecDecoder(TARGET, DRAFTERS[name](), _config(), prefix_cache=PrefixCache(0, block=BLOCK))
    without = SpecDecoder(TARGET, DRAFTERS[name](), _config())
    expected = _expected(PROMPTS, 12)
    reused = []
    for p, want in zip(PROMPTS, expected):
        before = cache.stats.tokens_reused
        got = with_cache.generate(torch.tensor(p)[None], max_new_tokens=12, eos_token_id=None, logprobs=2)
        reused.append(cache.stats.tokens_reused - before)
        assert got.generated(0).tolist() == want
        assert got.logprobs == cold.generate(torch.tensor(p)[None], max_new_tokens=12, eos_token_id=None,
                                             logprobs=2).logprobs
        assert without.generate(torch.tensor(p)[None], max_new_tokens=12, eos_token_id=None).generated(0).tolist() == want
    # what each took: nothing first; the system prompt's 5 blocks; 2 of them; 5 (its turn 1 only had
    # 46 tokens: 5 whole blocks); the exact 16-token prefix: 1 block (its last token is computed); none
    assert reused == [0, 40, 16, 40, 8, 0]
    assert cache.stats.hits == 4 and cache.stats.lookups == 6
    assert cache.stats.tokens_prefilled == sum(len(p) for p in PROMPTS) - sum(reused)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_in_a_batch_the_rows_share_the_cache_and_answer_as_without(name):
    cache = PrefixCache(MB, block=BLOCK)
    decoder = SpecDecoder(TARGET, DRAFTERS[name](), _config(), prefix_cache=cache)
    expected = _expected(PROMPTS, 10)
    cold = SpecDecoder(TARGET, DRAFTERS[name](), _config(), prefix_cache=PrefixCache(0, block=BLOCK))
    first = decoder.generate(PROMPTS, max_new_tokens=10, eos_token_id=None, logprobs=1)
    assert _answers(first) == expected
    assert cache.stats.tokens_reused == 40 + 16 + 40 + 8  # the batch's later rows took the first's blocks
    assert first.logprobs == cold.generate(PROMPTS, max_new_tokens=10, eos_token_id=None, logprobs=1).logprobs
    again = decoder.generate(PROMPTS[::-1], max_new_tokens=10, eos_token_id=None, logprobs=1)  # every row hits now
    assert _answers(again) == expected[::-1]
    assert again.logprobs == cold.generate(PROMPTS[::-1], max_new_tokens=10, eos_token_id=None, logprobs=1).logprobs
    assert _answers(SpecDecoder(TARGET, DRAFTERS[name](), _config()).generate(PROMPTS, max_new_tokens=10,
                                                                                eos_token_id=None)) == expected


def test_a_session_joining_rows_reuses_prefixes_too():
    from specdec.judging import Acceptance
    from specdec.session import DecodeSession

    cache = PrefixCache(MB, block=BLOCK)
    decoder = SpecDecoder(TARGET, PromptLookupDrafter(), _config(), prefix_cache=cache)
    session = DecodeSession(decoder, eos=set())
    got: dict[int, list[int]] = {}
    with decoder.running():
        ids, events = session.add([torch.tensor(PROMPTS[0])], [10], Acceptance())
        for _ in range(2):
            events += session.step()
        # (rows joining a run share its acceptance rule)
        more, joined = session.add([torch.tensor(PROMPTS[1]), torch.tensor(PROMPTS[2])], [10, 10], session.judge)
        assert [session.cached_tokens(s) for s in more] == [40, 16]
        events += joined
        while session.rows:
            events += session.step()
    for e in events:
        got.setdefault(e.sequence, []).extend(e.tokens)
    assert [got[s] for s in ids + more] == _expected(PROMPTS[:3], 10)


@pytest.mark.parametrize("make", [lambda: StreamingDrafter(TARGET, budget=24, sink=4, overshoot=8),
                                  lambda: SnapKVDrafter(TARGET, budget=24, window=8, kernel=3, overshoot=8)],
                         ids=["streaming", "snapkv"])
def test_self_speculation_drafts_over_reused_rows(make):
    """Self-speculative drafters build their compressed rows from the target's store at begin(): with a
    reused prefix it holds the same rows, so the answers and the drafts' acceptance are the same."""
    import warnings

    cache = PrefixCache(MB, block=BLOCK)
    with_cache = SpecDecoder(TARGET, make(), _config(3), prefix_cache=cache)
    cold = SpecDecoder(TARGET, make(), _config(3), prefix_cache=PrefixCache(0, block=BLOCK))
    prompts = [SYSTEM + _ids(21, 9), SYSTEM + _ids(22, 11)]
    expected = _expected(prompts, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short prompts fit the budget: the draft copies them whole
        for p, want in zip(prompts, expected):
            a = with_cache.generate(torch.tensor(p)[None], max_new_tokens=16, eos_token_id=None, logprobs=1)
            b = cold.generate(torch.tensor(p)[None], max_new_tokens=16, eos_token_id=None, logprobs=1)
            assert a.generated(0).tolist() == want == b.generated(0).tolist()
            assert a.accepted_per_sequence == b.accepted_per_sequence and a.logprobs == b.logprobs
    assert cache.stats.tokens_reused == 40


def test_a_cache_too_small_keeps_nothing_and_changes_nothing():
    cache = PrefixCache(100, block=BLOCK)  # one block of this model is 2 layers x 2 x 2 heads x 8 x 16 x 8 bytes
    decoder = SpecDecoder(TARGET, None, _config(), prefix_cache=cache)
    for p, want in zip(PROMPTS[:2], _expected(PROMPTS[:2], 6)):
        assert decoder.generate(torch.tensor(p)[None], max_new_tokens=6).generated(0).tolist() == want
    assert cache.nbytes == 0 and cache.stats.tokens_reused == 0


def test_the_budget_bounds_the_bytes_held():
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 8  # layers x (K, V) x heads x rows x head dim x float64
    cache = PrefixCache(3 * block_bytes, block=BLOCK)
    decoder = SpecDecoder(TARGET, None, _config(), prefix_cache=cache)
    for p in PROMPTS:
        decoder.generate(torch.tensor(p)[None], max_new_tokens=2)
        assert cache.nbytes <= 3 * block_bytes
    assert cache.index.evictions > 0


def test_one_cache_serves_one_target():
    cache = PrefixCache(MB)
    SpecDecoder(TARGET, prefix_cache=cache)
    SpecDecoder(TARGET, prefix_cache=cache)  # the same target again: fine
    with pytest.raises(ValueError, match="another target"):
        SpecDecoder(tiny_llama(6), prefix_cache=cache)


def test_seeded_sampling_draws_the_same_with_the_cache():
    cache = PrefixCache(MB, block=BLOCK)
    with_cache = SpecDecoder(TARGET, PromptLookupDrafter(), _config(), prefix_cache=cache)
    without = SpecDecoder(TARGET, PromptLookupDrafter(), _config())
    for p in PROMPTS[:3]:
        kw = dict(max_new_tokens=12, eos_token_id=None, do_sample=True, temperature=0.8, seed=7)
        assert torch.equal(with_cache.generate(torch.tensor(p)[None], **kw).sequences,
                           without.generate(torch.tensor(p)[None], **kw).sequences)
    assert cache.stats.tokens_reused > 0


def test_a_drafter_reading_hidden_states_leaves_the_cache_unused():
    from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead

    cache = PrefixCache(MB, block=BLOCK)
    decoder = SpecDecoder(TARGET, EagleDrafter(TARGET, EagleHead(TARGET), EagleConfig(total_tokens=6, depth=3, top_k=2)),
                          _config(), prefix_cache=cache)
    for p, want in zip(PROMPTS[:2], _expected(PROMPTS[:2], 8)):
        assert decoder.generate(torch.tensor(p)[None], max_new_tokens=8, eos_token_id=None).generated(0).tolist() == want
    assert cache.stats.lookups == 0 and cache.nbytes == 0


@pytest.mark.parametrize("weights", ["fp32", "packed"])
def test_the_default_model_gets_the_bits_of_no_reuse(real, weights):
    """The default model, fp32 (the ``real`` fixture's) and packed (the serve default): a GEMM's blocking
    and SDPA's path depend on the row count, so only the aligned prefill makes this hold."""
    from specdec.models import load_model

    model = real.model if weights == "fp32" else load_model("default", weights="packed").model
    ids = torch.randint(1, 40000, (200,), generator=torch.Generator().manual_seed(1))
    with SpecDecoder(model).running():
        cold = prefill_aligned(model, ids, 64)
        hit = [(k[0, :, :128], v[0, :, :128]) for k, v in cold.layers]
        warm = prefill_aligned(model, ids, 64, hit)
    assert torch.equal(warm.logits, cold.logits) and _layers_equal(warm.layers, cold.layers)
