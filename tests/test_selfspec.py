"""Self-speculation (StreamingLLM, SnapKV): selection rules on hand-made scores, the cost model on
hand numbers, and whole generations token-identical to HF greedy with the draft cache holding
exactly the target's own K/V rows."""

import copy
import json
import warnings

import pytest
import torch

from conftest import hf_greedy, tiny_llama
from specdec import SpecDecoder
from specdec.controller import DraftLengthConfig
from specdec.controller.cost import omega, read_ratio, shortest_paying_prompt, speedup
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
from specdec.forward import forward_block
from specdec.kv.bmc import BMCCache
from specdec.kv.compressed import group_scores, pool_scores, snapkv_keep, streaming_keep

# tiny_llama: 4 query heads, 2 KV heads (GQA groups of 2), float64
TARGET = tiny_llama(3, layers=2)
ALWAYS_DRAFT = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False, initial=3))


def _ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _prefilled(model, ids: torch.Tensor) -> BMCCache:
    cache = BMCCache.for_model(model, ids.shape[0])
    forward_block(model, cache, ids, None, None)
    cache.commit([list(range(ids.shape[1]))] * ids.shape[0])
    return cache


# -- selection rules ---------------------------------------------------------------------------

def test_streaming_keeps_the_sinks_and_the_most_recent_rows():
    assert streaming_keep(10, 2, 5).tolist() == [0, 1, 7, 8, 9]
    assert streaming_keep(10, 0, 3).tolist() == [7, 8, 9]
    assert streaming_keep(4, 2, 5).tolist() == [0, 1, 2, 3]  # fits: everything


def test_pooling_lends_a_hot_positions_score_to_its_neighbours():
    assert pool_scores(torch.tensor([[0.0, 3.0, 0.0, 0.0]]), 3).tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert pool_scores(torch.tensor([[0.0, 3.0, 0.0]]), 1).tolist() == [[0.0, 3.0, 0.0]]


def test_gqa_votes_sum_over_the_query_heads_of_each_group():
    scores = torch.arange(4 * 3, dtype=torch.float).reshape(1, 4, 3)  # query heads 0..3
    grouped = group_scores(scores, 2)
    assert grouped.shape == (1, 2, 3)
    assert torch.equal(grouped[0, 0], scores[0, 0] + scores[0, 1])
    assert torch.equal(grouped[0, 1], scores[0, 2] + scores[0, 3])


def test_snapkv_each_head_keeps_its_own_top_positions_and_the_window():
    votes = torch.zeros(2, 10)
    votes[0, [1, 4, 6]] = torch.tensor([5.0, 3.0, 4.0])
    votes[1, [0, 2, 7]] = torch.tensor([1.0, 9.0, 2.0])
    votes[:, 8:] = 100.0  # the window's own votes never take a selection slot
    keep = snapkv_keep(votes, length=10, budget=5, window=2, kernel=1)
    assert keep.tolist() == [[1, 4, 6, 8, 9], [0, 2, 7, 8, 9]]


def test_snapkv_pooling_keeps_the_neighbourhood_of_a_hot_position():
    votes = torch.zeros(1, 12)
    votes[0, 5] = 9.0
    votes[0, 1] = 4.0  # alone it beats 4 and 6, but pooled (kernel 3) it is 4/3 < 9/3
    assert snapkv_keep(votes, length=12, budget=5, window=2, kernel=3).tolist() == [[4, 5, 6, 10, 11]]


def test_snapkv_budget_below_the_window_keeps_the_most_recent_rows():
    assert snapkv_keep(torch.rand(2, 20), length=20, budget=3, window=8, kernel=7).tolist() == [[17, 18, 19]] * 2


def test_snapkv_prompt_within_the_budget_is_kept_whole():
    assert snapkv_keep(torch.rand(2, 6), length=6, budget=8, window=2, kernel=3).tolist() == [list(range(6))] * 2


# -- cost model ---------------------------------------------------------------------------------

def test_omega_counts_expected_tokens_per_step():
    assert omega(3, 0.8) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert omega(3, 1.0) == 4.0
    assert omega(0, 0.3) == 1.0
    assert omega(2, 0.0) == 1.0


def test_speedup_matches_the_worked_example():
    assert speedup(3, 0.8, t_target=0.1, t_draft=0.02, t_verify=0.11) == pytest.approx(2.952 * 0.1 / 0.17)


def test_the_prompt_from_which_a_compressed_draft_reads_few_enough_bytes():
    """read_ratio by hand: (W + kv budget) / (W + kv length); shortest_paying_prompt the first length
    at or under the ratio; a StreamingDrafter counts its target's bytes."""
    assert read_ratio(1000, 10, 50, 150) == pytest.approx(1500 / 2500)
    assert read_ratio(1000, 10, 50, 20) == 1.0  # a prompt inside the budget: nothing saved
    n = shortest_paying_prompt(1000, 10, 50, 0.75)  # (250 + 500) / 7.5 = 100
    assert n == 100 and read_ratio(1000, 10, 50, n) <= 0.75 < read_ratio(1000, 10, 50, n - 1)
    assert shortest_paying_prompt(1000, 10, 50, 0.99) == 52  # just past the budget (ratio 1 there)
    with pytest.raises(ValueError, match="max_ratio"):
        shortest_paying_prompt(1000, 10, 50, 1.0)
    drafter = StreamingDrafter(TARGET, budget=24, sink=2, overshoot=8)
    weights = sum(p.numel() * p.element_size() for p in TARGET.parameters())
    cfg = TARGET.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * TARGET.dtype.itemsize
    assert drafter.pays_from(0.75) == shortest_paying_prompt(weights, per_token, 28, 0.75)
    assert drafter.pays_from(0.5) > drafter.pays_from(0.75)
    # a batch of 4 reads the weights once and 4 rows' K/V: as one sequence with 4x the K/V a token
    assert drafter.pays_from(0.75, batch_size=4) == shortest_paying_prompt(weights, 4 * per_token, 28, 0.75)
    assert drafter.pays_from(0.75, batch_size=4) < drafter.pays_from(0.75)


def test_a_quantized_target_is_priced_by_its_blocks():
    """A quantized target's weights are buffers of blocks, not parameters: a step still reads them, so
    the prompt from which a compressed draft pays counts their bytes (counting parameters alone
    priced the weights at the norms' bytes and let StreamingLLM into ``auto`` at half the length)."""
    from specdec.quant import QuantLinear, quantize_model

    target = quantize_model(copy.deepcopy(TARGET), "Q8_0")
    blocks = sum(m.blocks.numel() for m in target.modules() if isinstance(m, QuantLinear))
    floats = sum(p.numel() * p.element_size() for p in target.parameters())
    assert blocks > floats  # the case this guards: most bytes are blocks
    cfg = target.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * TARGET.dtype.itemsize
    drafter = StreamingDrafter(target, budget=24, sink=2, overshoot=8)
    weights = sum(t.numel() * t.element_size() for t in (*target.parameters(), *target.buffers()))
    assert weights >= floats + blocks
    assert drafter.pays_from(0.75) == shortest_paying_prompt(weights, per_token, 28, 0.75)
    assert drafter.pays_from(0.75) > shortest_paying_prompt(floats, per_token, 28, 0.75)


def test_cost_model_rejects_an_acceptance_rate_outside_zero_one():
    with pytest.raises(ValueError, match="0 <= alpha <= 1"):
        omega(2, 1.5)


# -- whole generations ------------------------------------------------------------------------------

DRAFTERS = {
    "streaming": lambda budget: StreamingDrafter(TARGET, budget=budget, sink=4, overshoot=8),
    "snapkv": lambda budget: SnapKVDrafter(TARGET, budget=budget, window=8, kernel=3, overshoot=8),
}


@pytest.mark.parametrize("kind", list(DRAFTERS))
@pytest.mark.parametrize("seed,length,budget", [(0, 60, 16), (1, 100, 6), (2, 45, 24), (3, 90, 12), (4, 70, 9)])
def test_generation_equals_hf_greedy(kind, seed, length, budget):
    """Prompts past the budget, budgets below SnapKV's window of 8, partial acceptance."""
    ids = _ids(seed, length)
    drafter = DRAFTERS[kind](budget)
    config = ALWAYS_DRAFT if seed % 2 == 0 else SpecDecoderConfig()  # forced drafts, and the gated default
    out = SpecDecoder(TARGET, drafter, config).generate(ids, max_new_tokens=32)
    assert torch.equal(out.sequences, hf_greedy(TARGET, ids, 32))


def test_a_full_budget_draft_is_the_target_and_is_always_accepted():
    ids = _ids(0, 30)
    with pytest.warns(UserWarning, match="copies the whole cache"):
        out = SpecDecoder(TARGET, StreamingDrafter(TARGET, budget=1000), ALWAYS_DRAFT).generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(TARGET, ids, 24))
    drafted = [s for s in out.steps if s.num_drafted[0]]
    assert drafted and all(s.num_accepted == s.num_drafted for s in drafted)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_ragged_rows_draft_what_each_row_drafts_alone(kind):
    """Rows of different lengths (so different slot counts and position shifts) each draft from
    their own true positions: the batch proposes what each row proposes alone. (Ragged chains once
    took their positions shifted twice: on book prompts at batch 8 the drafts were accepted ~10%.)"""
    prompts = [_ids(11, 50), _ids(12, 71), _ids(13, 12)]  # the last fits the budget of 16 whole
    lengths = [p.shape[1] for p in prompts]
    batch = torch.zeros(3, max(lengths), dtype=torch.long)
    for i, p in enumerate(prompts):  # left-aligned rows; the store reads each row's own length
        batch[i, : lengths[i]] = p[0]
    source = BMCCache.for_model(TARGET, 3)
    for i, p in enumerate(prompts):
        single = _prefilled(TARGET, p)
        source.load_prefill(i, [(layer.keys[0, :, : lengths[i]], layer.values[0, :, : lengths[i]])
                                for layer in single.layers], capacity=max(lengths))
    pending = Commit(torch.tensor([[9], [5], [7]]), torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    together = DRAFTERS[kind](16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the short row is copied whole: said, and meant here
        together.begin(Prompt(batch, torch.tensor(lengths), cache=source))
    together.accept(pending)
    assert together.cache.lengths == [16, 16, 12] and together.cache.shift == [34, 55, 0]  # ragged slots
    chain = together.cache.prepare_chain(2).position_ids
    assert chain.tolist() == [[n, n + 1] for n in lengths]  # each row at its true next position
    drafts = together.propose(4).tokens
    for i, p in enumerate(prompts):
        alone = DRAFTERS[kind](16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            alone.begin(Prompt(p, torch.tensor([lengths[i]]), cache=_prefilled(TARGET, p)))
        alone.accept(Commit(pending.tokens[i : i + 1], torch.ones(1, dtype=torch.long),
                            torch.zeros(1, dtype=torch.long)))
        assert torch.equal(drafts[i], alone.propose(4).tokens[0]), f"row {i}"


def _match_rows(draft: torch.Tensor, target: torch.Tensor) -> list[int]:
    """draft [n, D], target [T, D]: the target row each draft row equals exactly (asserts one exists)."""
    eq = (draft[:, None, :] == target[None, :, :]).all(-1)  # [n, T]
    assert eq.any(1).all(), "a draft row is not any of the target's rows"
    return eq.float().argmax(1).tolist()


@pytest.mark.parametrize("kind", list(DRAFTERS))
@pytest.mark.parametrize("new_tokens", [7, 30])
def test_draft_cache_holds_exactly_the_targets_rows(kind, new_tokens):
    """After a step the draft's slots are copies of the target's K/V (no draft-computed row, no
    drift): the protected head at prompt positions, then the most recent committed rows in order."""
    ids = _ids(5, 70)
    drafter = DRAFTERS[kind](16)
    SpecDecoder(TARGET, drafter, ALWAYS_DRAFT).generate(ids, max_new_tokens=new_tokens)
    cache, source = drafter.cache, drafter.source
    n, T, head = cache.lengths[0], source.lengths[0], cache.protected[0]
    assert cache.next_positions() == [T]  # the pending token goes at the target's next position
    for dst, src in zip(cache.layers, source.layers):
        for h in range(src.keys.shape[1]):
            rows = _match_rows(dst.keys[0, h, :n], src.keys[0, h, :T])
            assert rows[head:] == list(range(T - (n - head), T))  # the recent rows, in order
            assert rows[:head] == sorted(rows[:head]) and all(r < 70 for r in rows[:head])
            assert torch.equal(dst.values[0, h, :n], src.values[0, h, rows])


def test_snapkv_heads_choose_different_prompt_rows():
    ids = _ids(2, 80)
    drafter = SnapKVDrafter(TARGET, budget=20, window=8, kernel=3)
    source = _prefilled(TARGET, ids)
    keep, protected = drafter.prompt_rows(Prompt(ids, torch.tensor([80]), cache=source), source)
    rows = keep[0]  # [layers, H, 20]
    assert rows.shape == (2, 2, 20) and protected == [12]
    assert torch.equal(rows[..., 12:], torch.arange(72, 80).expand(2, 2, 8))  # the window, every head
    assert not torch.equal(rows[:, 0], rows[:, 1])  # KV heads select their own positions


def test_observation_window_never_writes_the_targets_store():
    ids = _ids(4, 50)
    source = _prefilled(TARGET, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in source.layers]
    impl = TARGET.config._attn_implementation
    drafter = SnapKVDrafter(TARGET, budget=12, window=8)
    drafter.begin(Prompt(ids, torch.tensor([50]), cache=source))
    assert source.lengths == [50] and TARGET.config._attn_implementation == impl
    for (k, v), layer in zip(before, source.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_eviction_keeps_the_budget(kind):
    ids = _ids(6, 40)
    drafter = DRAFTERS[kind](16)
    lengths = []
    SpecDecoder(TARGET, drafter, ALWAYS_DRAFT).generate(
        ids, max_new_tokens=60, callback=lambda e: lengths.append(drafter.cache.lengths[0]))
    assert max(lengths) <= 16 + 8 + 1 + 10  # budget + overshoot + pending + the longest draft
    assert drafter.cache.num_compactions >= 3  # amortised: one gather per ~overshoot tokens, not per step
    assert drafter.cache.capacity <= 64  # buffers sized by the budget, never by the context


def test_dropping_a_batch_row_keeps_the_other_rows_state():
    ids = torch.cat([_ids(7, 40), _ids(8, 40)])
    pair = StreamingDrafter(TARGET, budget=12, sink=2)
    pair.begin(Prompt(ids, torch.tensor([40, 40]), cache=_prefilled(TARGET, ids)))
    single = StreamingDrafter(TARGET, budget=12, sink=2)
    single.begin(Prompt(ids[1:], torch.tensor([40]), cache=_prefilled(TARGET, ids[1:])))
    for d in (pair, single):
        B = d.cache.batch_size
        d.accept(Commit(torch.full((B, 1), 9), torch.ones(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)))
    pair.select([1])
    assert pair.cache.lengths == single.cache.lengths and pair.cache.shift == single.cache.shift
    for a, b in zip(pair.cache.layers, single.cache.layers):
        assert torch.allclose(a.keys[:, :, :12], b.keys[:, :, :12])
    assert torch.equal(pair.propose(3).tokens, single.propose(3).tokens)


# -- bad input ------------------------------------------------------------------------------------

def test_streaming_budget_below_sink_plus_one_is_refused():
    with pytest.raises(ValueError, match="streaming budget 4 must be at least sink \\+ 1 = 5 rows"):
        StreamingDrafter(TARGET, budget=4, sink=4)


def test_snapkv_even_kernel_is_refused():
    with pytest.raises(ValueError, match="odd kernel"):
        SnapKVDrafter(TARGET, budget=64, kernel=4)


def test_budget_over_the_prompt_degrades_to_the_full_cache_with_a_warning():
    ids = _ids(9, 20)
    drafter = SnapKVDrafter(TARGET, budget=64)
    with pytest.warns(UserWarning, match="prompt of 20 tokens fits the budget of 64 rows"):
        out = SpecDecoder(TARGET, drafter, ALWAYS_DRAFT).generate(ids, max_new_tokens=10)
    assert torch.equal(out.sequences, hf_greedy(TARGET, ids, 10))


def test_prompt_beyond_the_context_window_is_refused_before_any_drafting():
    small = tiny_llama(3, layers=1, max_pos=32)
    with pytest.raises(ValueError, match="does not fit the model's context window of 32 tokens"):
        SpecDecoder(small, SnapKVDrafter(small, budget=8)).generate(_ids(0, 32), max_new_tokens=4)


def test_drafter_without_the_targets_store_is_named():
    with pytest.raises(ValueError, match="needs the target's KV store"):
        StreamingDrafter(TARGET, budget=8).begin(Prompt(_ids(0, 10), torch.tensor([10])))


# -- the default model ------------------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.parametrize("name", ["streaming", "snapkv"])
def test_book_prompt_on_the_default_model_equals_hf_greedy(real, name):
    from conftest import shared_file

    books = shared_file("longctx/books.jsonl")
    if not books.exists():
        pytest.skip("book excerpts unavailable")
    text = json.loads(books.read_text().splitlines()[0])["text"]
    excerpt = real.tokenizer.decode(real.tokenizer(text)["input_ids"][:600])
    ids = real.tokenizer.apply_chat_template([{"role": "user", "content": excerpt + "\n\nContinue the story."}],
                                             add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    ref = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    drafter = (StreamingDrafter if name == "streaming" else SnapKVDrafter)(real.model, budget=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 600 tokens is past a 128-row budget: no degrade warning
        out = SpecDecoder(real.model, drafter, ALWAYS_DRAFT).generate(ids, max_new_tokens=16)
    assert torch.equal(out.sequences, ref), real.tokenizer.decode(out.sequences[0, ids.shape[1]:])
    assert sum(s.num_accepted[0] for s in out.steps) > 0


# -- bench-longctx figures --------------------------------------------------------------------------

def _step(drafted, accepted, draft_time, verify_time):
    from specdec.decoder import StepStats

    return StepStats([drafted], [accepted], draft_time, verify_time)


def test_bench_figures_from_steps_and_the_cost_models_prediction():
    from specdec.bench.longctx import predicted_speedup, step_figures

    steps = [_step(0, 0, 0.0, 9.0),  # the prefill: left out
             _step(3, 3, 0.3, 0.2), _step(3, 1, 0.3, 0.2), _step(0, 0, 0.0, 0.1)]
    fig = step_figures(steps)
    assert fig["accept_rate"] == pytest.approx(4 / 6) and fig["alpha"] == pytest.approx(4 / 5)
    assert fig["gamma"] == 3 and fig["t_draft"] == pytest.approx(0.1) and fig["t_verify"] == pytest.approx(0.2)
    assert fig["t_plain"] == pytest.approx(0.1) and fig["decode_seconds"] == pytest.approx(1.1)
    assert predicted_speedup(fig, t_target=0.1) == pytest.approx(omega(3, 0.8) * 0.1 / (0.3 + 0.2))
    assert predicted_speedup(step_figures(steps[:1] + steps[3:]), 0.1) == 1.0  # never drafted


def test_bench_records_predict_for_one_drafter_not_for_auto():
    from specdec.bench.longctx import LongPrompt, finish_records, step_figures

    prompt = LongPrompt(("b",), 100, "continue", (torch.arange(5),))
    plain = [_step(0, 0, 0.0, 9.0)] + [_step(0, 0, 0.0, 0.1)] * 4
    drafting = [_step(0, 0, 0.0, 9.0), _step(3, 3, 0.3, 0.2), _step(3, 1, 0.3, 0.2)]

    def result(steps, n):
        return {"outputs": [list(range(n))], "seconds": 10.0, "steps": len(steps), **step_figures(steps)}

    records = {r["method"]: r for r in finish_records(prompt, {
        "hf-generate": {"outputs": [list(range(5))], "seconds": 10.0},
        "none": result(plain, 5), "streaming@512": result(drafting, 7), "auto": result(drafting, 7)})}
    assert records["streaming@512"]["predicted"] == pytest.approx(omega(3, 0.8) * 0.1 / (0.3 + 0.2))
    assert records["auto"]["predicted"] is None  # its steps mix drafters: no single cost model
    assert records["auto"]["measured"] == pytest.approx((6 / 1.0) / (4 / 0.4))
    assert records["none"]["identical"] == 1 and records["auto"]["identical"] == 0
    # an int8 target's reference is its own plain decoding: rows equal to none's, whatever HF wrote
    own = {r["method"]: r for r in finish_records(prompt, {
        "hf-generate": {"outputs": [[9] * 5], "seconds": 10.0},
        "none": result(plain, 5), "auto": result(drafting, 5)}, reference="none")}
    assert own["none"]["identical"] == 1 and own["auto"]["identical"] == 1 and own["hf-generate"]["identical"] == 0


def test_bench_figures_at_a_batch_count_every_row_and_the_longest_draft():
    from specdec.bench.longctx import step_figures
    from specdec.decoder import StepStats

    steps = [StepStats([0, 0], [0, 0], 0.0, 9.0),  # the prefill
             StepStats([3, 1], [3, 0], 0.3, 0.4),  # row 0 all accepted, row 1 rejected its one draft
             StepStats([0, 2], [0, 1], 0.2, 0.4),  # only row 1 drafted
             StepStats([0, 0], [0, 0], 0.0, 0.2)]  # a plain step
    fig = step_figures(steps)
    assert fig["drafting_steps"] == 2 and fig["plain_steps"] == 1
    assert fig["gamma"] == pytest.approx(5 / 2)  # draft forwards: 3 (row 0's chain), then 2
    assert fig["t_draft"] == pytest.approx(0.5 / 5)
    assert fig["accept_rate"] == pytest.approx(4 / 6)
    assert fig["alpha"] == pytest.approx(4 / (3 + 1 + 2))  # trials: 3 (no rejection), 0 + 1, 1 + 1


class _CharTokenizer:
    """Characters as tokens; the chat template wraps the text in two marker tokens."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt, return_tensors, return_dict):
        return {"input_ids": torch.tensor([[1] + [ord(c) for c in messages[0]["content"]] + [2]])}


def test_bench_longctx_batches_group_consecutive_books():
    from specdec.bench.longctx import build_prompts

    books = [{"id": f"b{i}", "text": chr(97 + i) * 50} for i in range(5)]
    prompts = build_prompts(_CharTokenizer(), books, [10, 20], ["continue"], batch=2)
    assert [p.key for p in prompts] == ["B2:b0+b1/10/continue", "B2:b0+b1/20/continue",
                                        "B2:b2+b3/10/continue", "B2:b2+b3/20/continue"]  # b4 has no partner
    first = prompts[0].rows
    assert len(first) == 2 and first[0][1:11].tolist() == [97] * 10 and first[1][1:11].tolist() == [98] * 10
    single = build_prompts(_CharTokenizer(), books[:1], [10], ["summary"])
    assert single[0].key == "b0/10/summary"
    assert single[0].input_ids.shape == (1, 1 + 10 + len("\n\nSummarize the passage above.") + 1)
    with pytest.raises(ValueError, match="--batch-size 8 needs at least 8 books"):
        build_prompts(_CharTokenizer(), books, [10], ["continue"], batch=8)
    with pytest.raises(ValueError, match="fewer than --lengths 60"):
        build_prompts(_CharTokenizer(), books, [60], ["continue"])


def test_bench_longctx_methods_expand_budgets_and_keep_fixed_settings():
    from specdec.bench.longctx import MethodSpec, make_methods

    methods = make_methods(["hf-generate", "none", "streaming", "streaming@k=3", "auto", "prompt-lookup@k=4"],
                           [256, 512])
    assert [m.name for m in methods] == ["hf-generate", "none", "streaming@256", "streaming@512",
                                         "streaming@256@k=3", "streaming@512@k=3", "auto", "prompt-lookup@k=4"]
    assert methods[4] == MethodSpec("streaming@256@k=3", "streaming", 256, "k=3")
    assert methods[-1] == MethodSpec("prompt-lookup@k=4", "prompt-lookup", None, "k=4")


def test_bench_longctx_names_bad_lengths_before_loading_a_model(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as stop:  # the parser's error: exit status 2, one line
        main(["bench-longctx", "--lengths", "1k"])
    assert stop.value.code == 2
    assert "--lengths must be comma-separated integers, got '1k'" in capsys.readouterr().err
