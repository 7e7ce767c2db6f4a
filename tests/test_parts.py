"""Pure parts with hand-built tables: chain verification, prompt lookup, the draft-length controller,
and the GGUF cache's corruption check."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from controller_helpers import ask, gate, take
from specdec import model_cache, models
from specdec.config import RuntimeConfig
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.decoder import SpecDecoder
from specdec.drafters.base import Prompt
from specdec.drafters.prompt_lookup import NgramIndex, PromptLookupConfig, PromptLookupDrafter, find_continuation
from specdec.tree import DraftTree
from specdec.verifiers.tree import verify_greedy


def _logits(next_tokens, vocab=10):
    """Logits whose argmax at row i is next_tokens[i]: [1, Q, V]."""
    x = torch.zeros(1, len(next_tokens), vocab)
    x[0, torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 1.0
    return x


@pytest.mark.parametrize("drafts,target_next,accepted,bonus", [
    ([5, 7, 9], [5, 7, 9, 3], 3, 3),  # all accepted: bonus from the last row
    ([5, 7, 9], [4, 7, 9, 3], 0, 4),  # none accepted: the target's correction
    ([5, 7, 9], [5, 1, 9, 3], 1, 1),  # early mismatch: later agreement does not count
    ([], [6], 0, 6),  # empty draft: plain decoding
])
def test_chain_verification_table(drafts, target_next, accepted, bonus):
    tree = DraftTree.chain(torch.tensor([drafts], dtype=torch.long).reshape(1, len(drafts)))
    ver = verify_greedy(_logits(target_next), tree)
    assert ver.num_accepted.tolist() == [accepted]
    assert ver.next_token.tolist() == [bonus]
    assert ver.kept_rows() == [list(range(accepted + 1))]


def test_ragged_chain_padding_is_never_accepted():
    tree = DraftTree.chain(torch.tensor([[5, 7, 9]]), num_nodes=torch.tensor([1]))
    ver = verify_greedy(_logits([5, 7, 9, 3]), tree)
    assert ver.num_accepted.tolist() == [1] and ver.next_token.tolist() == [7]


@pytest.mark.parametrize("seq,n,k,expect", [
    ([1, 2, 3, 9, 1, 2], 2, 3, [3, 9, 1]),
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, [4, 1]),  # the most recent match wins
    ([1, 2, 3], 2, 5, []),  # no earlier occurrence
    ([7], 1, 3, []),  # too short
    ([4, 4, 4], 1, 5, [4]),  # overlapping match, continuation cut at the end
])
def test_find_continuation(seq, n, k, expect):
    assert find_continuation(np.array(seq), n, k).tolist() == expect
    assert NgramIndex(seq, 1, 3).continuation(n, k) == expect


def test_ngram_index_matches_the_scan_as_the_text_grows():
    """2,000 random texts over small alphabets (many repeats), grown in random chunks: after every
    chunk the index's continuation equals the full scan's for every n and draft length."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        alphabet, length = int(rng.integers(2, 6)), int(rng.integers(1, 40))
        text = rng.integers(0, alphabet, size=length).tolist()
        cut = int(rng.integers(0, length + 1))
        index = NgramIndex(text[:cut], 1, 3)
        while cut < length:
            step = int(rng.integers(1, 4))
            index.extend(text[cut : cut + step])
            cut = min(length, cut + step)
            seq = np.array(text[:cut])
            for n in (1, 2, 3):
                k = int(rng.integers(1, 6))
                assert index.continuation(n, k) == find_continuation(seq, n, k).tolist(), (text[:cut], n, k)


def test_controller_follows_bass_heuristic():
    c = DraftLengthController(DraftLengthConfig(initial=4, minimum=1, maximum=8, cost_aware=False))
    c.update([4], [4])
    assert ask(c) == 6  # all accepted: +2
    c.update([6], [2])
    assert ask(c) == 5  # shrink by one
    c.update([5], [5])
    c.update([7], [7])
    assert ask(c) == 8  # capped
    for _ in range(10):
        c.update([8], [0])
    assert ask(c) == 1  # floor
    c.update([0], [0])
    assert ask(c) == 1  # nothing drafted: nothing learned


def test_controller_rejects_inconsistent_config():
    with pytest.raises(ValueError, match="minimum <= initial <= maximum"):
        DraftLengthController(DraftLengthConfig(initial=12, maximum=10))


def test_gguf_cache_detects_truncation_and_bit_flips(tmp_path):
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"x" * 4096)
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": model_cache.CACHE_FORMAT, "size": 4096, "sha256": model_cache.sha256(w)}))
    assert model_cache.is_valid(tmp_path)
    w.write_bytes(b"x" * 4095 + b"y")  # same size, one byte changed
    assert not model_cache.is_valid(tmp_path)
    w.write_bytes(b"x" * 100)  # truncated
    assert not model_cache.is_valid(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    assert not model_cache.is_valid(tmp_path)


def test_corrupt_gguf_cache_is_rebuilt_not_used(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(model_cache, "current_runtime", lambda: RuntimeConfig(cache_dir=tmp_path / "cache"))
    d = model_cache.gguf_folder(gguf, torch.float32)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"garbage")
    built = []

    def fake_build(src, dtype, dest):
        built.append(dest)
        raise RuntimeError("stop after the rebuild decision")

    monkeypatch.setattr(models, "_build_gguf_cache", fake_build)
    with pytest.raises(RuntimeError, match="stop after"):
        models._load_gguf_cached(gguf, torch.float32, "m")
    assert built == [d]


def test_corrupt_gguf_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(model_cache, "current_runtime", lambda: RuntimeConfig(cache_dir=tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(models.ModelLoadError, match="could not read GGUF file .*broken.gguf"):
        models.load_model(str(bad))


def _cost_aware(**kw):
    return DraftLengthController(DraftLengthConfig(**{"initial": 4, "minimum": 1, "maximum": 8, **kw}))


def _chain_step(c, drafted, accepted, key=None, **times):
    """What the decoder tells the controller after verifying one chain per row."""
    c.update(drafted, accepted, key=key, **times)
    if any(drafted):
        c.observe_tree([list(range(-1, d - 1)) for d in drafted], [list(range(a)) for a in accepted], key)


def test_cost_gate_turns_drafting_off_when_acceptance_cannot_pay():
    c = _cost_aware(explore_every=4)
    c.update([0], [0], verify_time=1.0)  # a plain step: t(1) = 1
    _chain_step(c, [4], [0], verify_time=1.4)  # t(5) = 1.4, nothing accepted: alpha = 0
    assert c.alpha == 0.0
    budgets = [ask(c) for _ in range(12)]
    assert budgets == [0, 0, 0, 1] + [0] * 7 + [1]  # off; one-token probes after 4, then 8 steps


def test_one_missed_draft_is_not_yet_a_verdict_at_batch_1():
    """StreamingLLM at 7k on the packed target, as traced: the answer's first draft (3 tokens) was
    rejected whole, the acceptance table then priced every length out, and 8 plain steps, a missed
    probe and 16 more followed, while the measured gain (1 step of min_samples = 3) was not judged
    yet. A chain now drafts a token until it is, as a tree's gate drafts a node; at a batch, where a
    drafting step verifies B rows a token, the table's price stands."""
    c = _cost_aware(explore_every=8)
    c.update([0], [0], verify_time=1.0)
    _chain_step(c, [3], [0], verify_time=1.4, draft_time=1.5)  # rejected whole: table prices 0
    assert ask(c) == 1
    _chain_step(c, [1], [0], verify_time=1.1, draft_time=0.5)
    assert ask(c) == 1  # two of three
    _chain_step(c, [1], [0], verify_time=1.1, draft_time=0.5)
    assert ask(c) == 0  # judged: it does not pay
    b = _cost_aware(explore_every=8)
    b.set_batch(4)
    b.update([0] * 4, [0] * 4, verify_time=1.0)
    _chain_step(b, [3] * 4, [0] * 4, verify_time=2.0, draft_time=1.5)
    assert ask(b) == 0


def test_cost_gate_times_a_plain_step_first():
    c = _cost_aware()
    assert ask(c) == 0
    c.update([0], [0], verify_time=1.0)
    assert ask(c) == c.length  # acceptance not measured yet: BASS's initial length


def test_cost_gate_keeps_drafting_when_acceptance_pays():
    c = _cost_aware()
    c.update([0], [0], verify_time=1.0)
    _chain_step(c, [4], [4], verify_time=1.4)  # all accepted: alpha = 1, 5 tokens for 1.4x
    assert c.length == 6  # BASS grew (its length caps only its own policy, without the gate)
    assert ask(c) == 5  # one row past the 5 timed: assumed to cost what 5 did, and so timed next
    _chain_step(c, [5], [5], verify_time=1.4)
    assert ask(c) == 6


def test_cost_gate_picks_the_cheapest_length_that_pays():
    """Block sizes 2-4 cost the same (1.36x), 5+ cost 1.8x. Chains accepted token by token at 0.5
    (half stop at depth 1, a quarter at 2, ...): three drafts win. Chains copied whole or not at all
    (half rejected at once, half accepted to the end: what prompt lookup's copies do): seven win,
    although depth 1 is accepted as often; one acceptance rate for every depth would draft three."""
    costs = {1: 1.0, 2: 1.36, 3: 1.36, 4: 1.36, 5: 1.8, 6: 1.8, 7: 1.8, 8: 1.8}
    geometric, whole = _cost_aware(), _cost_aware()
    for i in range(40):
        _chain_step(geometric, [7], [[0, 0, 0, 0, 1, 1, 2, 3][i % 8]])
        _chain_step(whole, [7], [7 * (i % 2)])
    for c in (geometric, whole):
        c.step_time = dict(costs)
    assert geometric.best_length(7) == 3 and whole.best_length(7) == 7
    assert geometric.expected_tokens(3) == pytest.approx(1.875, abs=0.06)
    geometric.draft_time = 1.0  # a drafter as slow as the target: no length pays
    assert geometric.best_length(7) == 0


def test_chain_acceptance_per_depth_is_smoothed_toward_the_depth_above():
    """The hand-checked example of PositionalAcceptance.chain; an untried depth reads as the one
    above; one miss in one trial does not read as 0."""
    from specdec.controller.cost import chain_values
    from specdec.controller.tables import PositionalAcceptance

    pos = PositionalAcceptance(decay=1.0)
    for drafted, accepted in [(2, 2)] * 3 + [(2, 1)] + [(1, 1)] + [(1, 0)] * 5:
        pos.observe_chain(drafted, accepted)
    # depth 1: 10 trials, 5 hits; depth 2: 4 trials, 3 hits (the example in the docstring)
    assert pos.chain(3) == pytest.approx([5.571 / 11, 0.7013, 0.7013], abs=1e-3)
    assert chain_values([0.5, 0.8]) == pytest.approx([0.0, 0.5, 0.9])
    one = PositionalAcceptance(decay=1.0)
    one.observe_chain(2, 1)
    # pooled 1 / 2; depth 1 (1 + .5) / 2; depth 2, one trial missed: (0 + .75) / 2, not 0
    assert one.chain(2) == pytest.approx([0.75, 0.375])


def test_positional_acceptance_decays_only_the_cells_tried_and_matches_decaying_all():
    """The decay skips the cells past the deepest depth and rank ever tried (zeros stay zeros): 3,000 seeded
    random trees, chains and shadow-judged trees give the same tables, bit for bit, as decaying every cell."""
    import random

    from specdec.controller.tables import PositionalAcceptance

    class EveryCell(PositionalAcceptance):
        def observe(self, parents, accepted, judged=None):
            if parents:
                for row_t, row_h in zip(self.trials, self.hits):
                    for r in range(self.max_rank):
                        row_t[r] *= self.decay
                        row_h[r] *= self.decay
                self.used = (0, 0)  # the parent's decay then touches nothing: every cell was decayed above
            super().observe(parents, accepted, judged)

    rng = random.Random(0)
    fast, full = PositionalAcceptance(max_depth=6, max_rank=3, decay=0.9), EveryCell(max_depth=6, max_rank=3, decay=0.9)
    for _ in range(3000):
        n = rng.randrange(0, 12)
        parents = [rng.randrange(-1, i) for i in range(n)]  # parents precede their children
        path, node = [], -1
        while True:  # an accepted path: root down, each node a child of the one before
            kids = [i for i, p in enumerate(parents) if p == node]
            if not kids or rng.random() < 0.3:
                break
            node = rng.choice(kids)
            path.append(node)
        judged = rng.choice([None, rng.randrange(0, 8)])
        for pa in (fast, full):
            pa.observe(parents, path, judged)
        assert fast.trials == full.trials and fast.hits == full.hits
    assert fast.used[0] > 1 and fast.used[1] > 1  # deep and wide trees were seen: the skip was exercised


def test_draft_time_is_each_classs_own():
    """Two sources with one acceptance rate: free drafts (prompt lookup) pay, drafts that cost a
    target step per token do not. One shared draft time would size both alike."""
    c = _cost_aware()
    c.update([0], [0], verify_time=1.0)
    for _ in range(30):  # interleaved, as a chooser's sources are
        _chain_step(c, [2], [1], verify_time=1.36, draft_time=0.0, key="lookup")
        _chain_step(c, [2], [1], verify_time=1.36, draft_time=2.0, key="self")
    c.step_time = {1: 1.0, 2: 1.36, 3: 1.36, 4: 1.36, 5: 1.8}
    assert c.state("lookup").alpha == c.state("self").alpha == pytest.approx(0.5)
    assert c.draft_cost(1, "lookup") == 0.0 and c.draft_cost(1, "self") == pytest.approx(1.0)
    assert c.best_length(4, "lookup") > 0 and c.best_length(4, "self") == 0
    assert c.draft_cost(1, "new") == c.draft_time  # a class that never drafted: the mean over all


def test_verify_cost_in_decoder_times_each_block_and_stays_exact(target):
    """The in-place curve: a fixed draft of q - 1 junk tokens per row (chain and star) times whole
    decoder steps, and the output is still the target's own (every junk token is rejected)."""
    from specdec.bench import verify_cost

    lines = []
    for tree in (False, True):
        med = verify_cost.measure_in_decoder(target, context=12, sizes=(1, 3), repeats=1, batch=2, steps=3,
                                             tree=tree, profile_top=2, say=lines.append)
        assert set(med) == {1, 3} and all(t > 0 for t in med.values())
    assert len(lines) == 4 and all(line.startswith("q = ") for line in lines)
    prompt = torch.randint(3, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    ref = SpecDecoder(target).generate(prompt, max_new_tokens=8, eos_token_id=[-1]).generated(0)
    out = SpecDecoder(target, verify_cost.FixedDraft(3, tree=True)).generate(prompt, max_new_tokens=8,
                                                                            eos_token_id=[-1])
    assert out.generated(0).tolist() == ref.tolist()


def test_verify_cost_bench_measures_every_method_and_size(target):
    from specdec.bench import verify_cost

    med = verify_cost.measure(target, context=16, sizes=(1, 4), repeats=2)
    assert set(med) == set(verify_cost.METHODS)
    assert all(set(per) == {1, 4} and all(t > 0 for t in per.values()) for per in med.values())


def test_cost_gate_keeps_acceptance_per_draft_class():
    """A class that is never accepted is gated off while another, always accepted, keeps drafting."""
    c = _cost_aware(explore_every=100)
    c.update([0], [0], verify_time=1.0)
    for _ in range(3):
        _chain_step(c, [4], [0], verify_time=1.4, key=1)  # 1-gram matches: rejected
        _chain_step(c, [4], [4], verify_time=1.4, key=3)  # 3-gram matches: copied in full
    assert c.state(1).alpha == 0.0 and c.state(3).alpha == 1.0
    assert ask(c, 1) == 0
    assert ask(c, 3) == 5 and c.state(3).length == 8  # the cost model's length, one row past 5 timed
    assert ask(c, 2) == c.config.initial  # a class never seen: not measured yet, try it


def test_prompt_lookup_class_is_the_matched_ngram_size():
    d = PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=1, max_draft=4))
    d.begin(Prompt(torch.tensor([[5, 6, 7, 8, 9, 1, 6, 7]]), torch.tensor([8])))
    assert d.draft_class() == 2  # [6 7] occurred before; [1 6 7] did not
    assert d.propose(3).tokens.tolist() == [[8, 9, 1]]
    d.begin(Prompt(torch.tensor([[5, 6, 7, 4]]), torch.tensor([4])))
    assert d.draft_class() == 0 and d.propose(3).num_nodes.tolist() == [0]


def test_cost_gate_is_optimistic_about_untimed_sizes_one_row_at_a_time():
    """The next untimed block size (one row past the largest timed) is assumed as cheap as the nearest
    smaller timed one: drafted when that would pay, and so timed; once timed dear, the gate falls
    back. Bigger untimed sizes are not priced at all (at batch 8 that optimism cost 3.9x steps)."""
    c = _cost_aware()
    for i in range(20):
        _chain_step(c, [6], [6 * (i % 5 > 0)])  # 4 of 5 chains accepted whole
    c.step_time = {1: 1.0, 2: 1.0}  # only 1 and 2 rows timed
    assert c.best_length(6) == 2
    c.step_time[3] = 1.0
    assert c.best_length(6) == 3
    c.step_time.update({q: 5.0 for q in range(3, 8)})  # timed: 3+ rows cost 5x
    assert c.best_length(6) == 1


def test_gate_for_self_sized_drafts_follows_measured_throughput():
    """Drafting steps that yield 1.5 tokens in 2x a plain step's time lose: the gate closes and
    probes on the schedule; steps that yield 3 tokens in 1.5x win: it stays open."""
    c = _cost_aware(explore_every=2, gate_decay=0.8)
    assert not gate(c)  # no plain step timed yet
    c.update([0], [0], verify_time=1.0)
    assert gate(c)  # drafting not measured yet: try it
    for _ in range(5):
        c.update([5], [0], verify_time=1.6, draft_time=0.4)  # 1 token per 2.0 s
    assert [gate(c) for _ in range(6)] == [False, True, False, False, False, True]  # probes at 2, then 4
    c.update([5], [4], verify_time=1.2, draft_time=0.3)
    for _ in range(10):
        c.update([5], [2], verify_time=1.2, draft_time=0.3)  # 3 tokens per 1.5 s
    assert gate(c) and gate(c)


def test_a_drafters_resume_counts_in_the_gain_not_in_the_draft_price():
    """Seconds a drafter spent catching up after a pause (Drafter.resume_seconds) are a price of
    drafting again: in the step's gain; a draft size's price (what sizes the next drafts) leaves them out."""
    c = _cost_aware()
    c.update([0], [0], verify_time=1.0)
    c.update([3], [1], verify_time=1.0, draft_time=0.5, resume=0.5)  # 2 tokens in 2 steps' time
    assert c.state().gain == pytest.approx(1.0)
    assert c.draft_cost(3) == pytest.approx(0.5)


def test_gate_judges_a_class_after_min_samples_and_reopens_after_good_probes():
    """The first drafting step of an answer often misses (0.6x a plain step's rate): one step is not
    a measurement, the gate stays open until ``min_samples`` (3) are in, then judges their plain
    mean. Three poor steps close it; one winning probe (2.7x) reopens it at once (with the long
    running mean alone, a poor start kept it shut for ~14 winning probes): its gain is measured
    afresh from it, and probes come every ``explore_every`` steps again."""
    poor = dict(verify_time=1.4, draft_time=0.2)  # 1 token per 1.6 steps: gain 0.625
    good = dict(verify_time=1.4, draft_time=0.1)  # 4 tokens per 1.5 steps: gain 2.67
    c = _cost_aware(explore_every=2)
    c.update([0], [0], verify_time=1.0)
    c.update([5], [0], **poor)
    assert gate(c)
    c.update([5], [3], **good)
    c.update([5], [3], **good)
    assert c.state().gain == pytest.approx((0.625 + 2 * 4 / 1.5) / 3) and gate(c)
    c = _cost_aware(explore_every=2)
    c.update([0], [0], verify_time=1.0)
    for _ in range(3):
        c.update([5], [0], **poor)
    assert not gate(c) and gate(c)  # closed; a probe at 2
    c.update([5], [3], **good)
    assert c.state().gain == pytest.approx(4 / 1.5) and c.state().gain_samples == 1
    assert gate(c) and c.state().interval == 2
    for _ in range(5):
        c.update([5], [0], **poor)  # the mean of the fresh measurement: (2.67 + 5 x 0.625) / 6 < 1
    assert [gate(c) for _ in range(2)] == [False, True]  # closed again, a probe at 2


def _poor_start(steps: int, draft_per_token: float, verify_per_row: float) -> list[int]:
    """Chain lengths a controller drafts through an answer whose first two drafts miss (1 of 3, 0 of
    1) and whose every draft after is taken whole, with a draft token costing ``draft_per_token``
    plain steps and a verify 1 + ``verify_per_row`` per extra row (StreamingLLM at 7k, as traced)."""
    c = _cost_aware(explore_every=8, maximum=10)
    verify = lambda q: 1.0 + verify_per_row * (q - 1)  # noqa: E731
    c.update([0], [0], verify_time=verify(1))
    drafted = []
    for i in range(steps):
        k = [3, 1][i] if i < 2 else ask(c)
        accepted = [1, 0][i] if i < 2 else k
        _chain_step(c, [k], [accepted], verify_time=verify(1 + k), draft_time=draft_per_token * k or None)
        drafted.append(k)
    return drafted


def test_chain_drafts_climb_back_after_a_poor_start():
    """StreamingLLM at 7k tokens, as traced: a draft costs 0.55 plain steps per token, a verify 1 +
    0.07 per extra row. One-token probes re-measured depth 1 only and the early miss at depth 2 priced
    longer drafts out, while the poor first mean held the gate shut (7 drafting steps in 250). Now
    the first winning probe restarts the gain, and each draft taken whole is followed by one a
    token longer, up to the maximum."""
    drafted = _poor_start(100, 0.55, 0.07)
    assert drafted[2] == 1  # a third drafting step before the gain is judged, whatever the table prices
    first = next(i for i in range(3, 100) if drafted[i])
    assert first == 10 and drafted[first] == 1  # one probe, 8 steps after the gate closed
    assert drafted[first + 1 : first + 10] == list(range(2, 11))  # each one longer than the last
    assert min(drafted[first:]) >= 1 and drafted[-50:] == [10] * 50


def test_a_probe_that_pays_reopens_drafting_whatever_the_old_misses_predict():
    """StreamingLLM at 7k tokens after the attention kernel, as traced (2026-11-25): a draft token
    costs 0.68 plain steps, a verify 1 + 0.045 per extra row. The winning probes restarted the gain,
    but the acceptance table, still weighing the first misses, priced every length out: 80 steps of
    plain decoding, with probes of 1-3 tokens taken whole. Where the measured gain says drafting
    pays, at least a token is drafted now, so the table learns the new text, and once it prices a
    length in, each draft taken whole is followed by one a token longer."""
    drafted = _poor_start(60, 0.68, 0.045)
    assert drafted[2] == 1  # a third drafting step before the gain is judged
    first = next(i for i in range(3, 60) if drafted[i])
    assert first == 10 and drafted[first] == 1  # one probe, 8 steps after the gate closed
    assert drafted[first + 1] == 1  # reopened: a token while the table prices more out
    assert drafted[first + 2 : first + 7] == [2, 3, 4, 5, 6]  # then a token past each one taken whole
    assert drafted[-20:] == [10] * 20  # and drafting for good, at the longest length


def test_a_draft_taken_whole_grows_only_where_a_longer_one_would_pay_taken_whole():
    """StreamingLLM at 7k on the packed default model, as recorded (the AMD EPYC): verifies of 2-3 rows cost
    1.07-1.18 plain steps, then ~0.3 a row; a draft token 0.45. Every draft is taken whole. A token past
    each whole draft ramped the chain to 10, 5% dearer a token than 2 even taken whole; now it grows only
    where the longer chain taken whole costs no more a token than the table's length is expected to. Where
    a verify row is cheap (1 + 0.07 per row) it still ramps to the maximum."""
    recorded = {1: 19.9, 2: 21.3, 3: 23.4, 4: 31.0, 5: 33.8, 6: 43.9, 7: 47.4, 8: 56.3, 9: 64.8, 10: 63.7, 11: 73.0}

    def drafted(verify, per_token):
        c = _cost_aware(explore_every=8, maximum=10)
        c.update([0], [0], verify_time=verify(1))
        ks = []
        for _ in range(120):
            k = ask(c)
            _chain_step(c, [k], [k], verify_time=verify(1 + k), draft_time=per_token * k or None)
            ks.append(k)
        return ks

    steep = drafted(lambda q: recorded[q] / recorded[1], 8.9 / recorded[1])
    assert steep[0] == 4 and max(steep[10:]) <= 4 and steep[-50:] == [2] * 50
    assert drafted(lambda q: 1.0 + 0.07 * (q - 1), 0.55)[-50:] == [10] * 50


def test_chain_probes_lengthen_while_taken_whole():
    """Where a verify is dear (each extra row 1.5x a step) a probe taken whole still loses, so the
    gate stays shut; the next probe is two tokens longer (1, 3, 5), re-measuring deeper depths, and a
    probe that misses starts again from what it got (at a batch every probe is one token per row)."""
    c = _cost_aware(explore_every=2, maximum=10)
    c.update([0], [0], verify_time=1.0)
    for _ in range(3):
        _chain_step(c, [2], [0], verify_time=2.5, draft_time=0.1)
    probes = []
    for i in range(400):  # probes cost 1.5 steps: probe_share spaces them 75 steps apart
        k = ask(c)
        if k:
            probes.append(k)
            got = k if len(probes) < 3 else 1
            _chain_step(c, [k], [got], verify_time=1.0 + 1.5 * k, draft_time=0.1 * k)
    assert probes[:4] == [1, 3, 5, 1]
    c.set_batch(4)
    c.update([0] * 4, [0] * 4, verify_time=1.0)
    assert {ask(c) for _ in range(200)} == {0, 1}


def test_tree_probes_are_sized_as_chain_probes():
    """A tree drafter whose gate closed probes with one node (then more while probes are taken whole),
    not a whole Sequoia tree; at a batch one node per row."""
    c = _cost_aware(explore_every=2)
    c.update([0], [0], verify_time=1.0)
    verify = lambda n: 1.0 + 0.01 * n  # noqa: E731  (a probe costs 1% of a step: spaced by explore_every)
    tree = [-1, 0, 1, -1, 3, 3]  # two branches of three levels, six nodes
    for _ in range(3):  # three trees that win nothing, each drafting 0.3 of a step: the gate closes
        n = ask(c, "t", 6, tree=True)
        c.update([n], [0], verify_time=verify(n), draft_time=0.3, key="t")
        c.observe_tree([tree[:n]], [[]], key="t")
    c.state("t").values = [0.0, 1.0, 1.5, 1.8, 2.0, 2.1, 2.2]  # as if Sequoia wanted all six nodes
    c.config = dataclasses.replace(c.config, retree_every=10**6)
    assert [ask(c, "t", 6, tree=True) for _ in range(3)] == [0, 1, 0]  # closed; a one-node probe at 2
    c.update([1], [1], verify_time=verify(1), draft_time=1.2, key="t")  # taken whole, still a loss
    sizes = [ask(c, "t", 6, tree=True) for _ in range(4)]
    assert sizes == [0, 0, 0, 3]  # the next probe, 4 steps on, three nodes (not six)
    c.set_batch(4)
    c.update([0] * 4, [0] * 4, verify_time=1.0)
    assert {ask(c, "t", 6, tree=True) for _ in range(200)} == {0, 1}


def test_at_a_batch_measured_gain_vetoes_the_prediction():
    """Batch of 4, one row drafts 3 tokens and gets them all (alpha = 1: the model predicts a win),
    but the step costs 2x a plain one and the other rows yield 1 token each: 1.75 tokens per row in
    2 plain steps' time loses, so drafting stops (a probe every few steps)."""
    c = _cost_aware(explore_every=3)
    c.set_batch(4)
    c.update([0] * 4, [0] * 4, verify_time=1.0)
    k = ask(c)
    assert k > 0
    for _ in range(c.config.min_samples):  # the gain is judged once min_samples steps are measured
        _chain_step(c, [3, 0, 0, 0], [3, 0, 0, 0], verify_time=2.0, draft_time=0.0)
    assert c.alpha == 1.0 and c.best_length(3) > 0  # the prediction alone would draft
    assert [ask(c) for _ in range(3)] == [0, 0, 1]  # measured: it does not pay; probes
    c.set_batch(1)  # another batch size has its own step times: a plain step is timed first
    assert ask(c) == 0


def test_probes_are_spaced_by_what_a_probe_costs_at_the_batch():
    """At batch 8 a one-token probe verifies 16 rows: measured at 2.2x a plain step, probes may cost
    at most probe_share = 2% of the run, so they come every ceil(1.2 / 0.02) = 60 steps, not every 3."""
    c = _cost_aware(explore_every=3)
    c.set_batch(8)
    c.update([0] * 8, [0] * 8, verify_time=1.0)
    _chain_step(c, [1] * 8, [0] * 8, verify_time=2.2, draft_time=0.0)  # a probe that won nothing
    budgets = [ask(c) for _ in range(130)]
    assert [i for i, b in enumerate(budgets) if b] == [59, 119]
    c.set_batch(7)  # a row finished: batch 7 has no timings yet; batch 8's probe cost stands in
    assert c.probe_cost() == pytest.approx(1.2)
    assert not any(ask(c) for _ in range(50))


def test_probes_of_a_source_that_catches_up_are_spaced_by_its_catch_up_too():
    """EAGLE at batch 8 feeds its head the prompt and the skipped text before a probe can draft: a
    probe costs that catch-up (3.8 plain steps here) beside its 16-row verify (1.2 steps more), so at
    probe_share = 2% probes come every 5 / 0.02 = 250 steps, not every 60."""
    c = _cost_aware(explore_every=3)
    c.set_batch(8)
    c.update([0] * 8, [0] * 8, verify_time=1.0)
    for _ in range(c.config.min_samples):
        _chain_step(c, [1] * 8, [0] * 8, key="eagle", verify_time=2.2, draft_time=0.0, catch_up=3.8)
    budgets = [ask(c, "eagle") for _ in range(300)]
    assert [i for i, b in enumerate(budgets) if b] == [249]


def test_at_batch_1_probes_are_spaced_by_the_catch_up_of_pauses_not_of_the_prompt():
    """A draft model feeds the prompt at an answer's first draft (12 plain steps here): at batch 1 a later
    probe never pays that again, only the text of its pause, so the prompt's feed does not space probes
    (they come on the explore interval, 4, 10, 22, ...); a pause's catch-up of 3.8 steps does (every
    ceil((0.1 + 3.8) / 0.02) = 195 steps). Priced by the prompt, no probe came in a 256-token answer."""
    for resume, probes in ((0.0, [4, 10, 22, 46, 70, 94]), (3.8, [194])):
        c = _cost_aware(explore_every=3)
        c.update([0], [0], verify_time=1.0)
        _chain_step(c, [1], [0], key="model", verify_time=1.1, draft_time=0.0, catch_up=12.0)  # the prompt
        for _ in range(c.config.min_samples - 1):  # drafts after pauses, or right after a step (0 s)
            _chain_step(c, [1], [0], key="model", verify_time=1.1, draft_time=0.0, catch_up=resume, resume=resume)
        budgets = [ask(c, "model") for _ in range(300)]
        assert [i for i, b in enumerate(budgets) if b][:6] == probes


def test_each_batch_size_has_its_own_measured_gain():
    """A copy class that pays at batch 1 (3 tokens in 1.1 steps) and loses at batch 8 (1.25 tokens
    per row in 1.6 steps): the gain measured at 8 rows closes the gate at 8 (and at 7, which starts
    from 8's, its nearest), not at 1, where the class drafts again. One gain for all sizes let the
    batch's last, small steps keep drafting open at 8 rows."""
    c = _cost_aware(explore_every=3)
    c.update([0], [0], verify_time=1.0)
    for _ in range(c.config.min_samples):
        _chain_step(c, [2], [2], key="copy", verify_time=1.1, draft_time=0.0)
    assert c.state("copy").gain == pytest.approx(3 / 1.1)
    c.set_batch(8)
    c.update([0] * 8, [0] * 8, verify_time=1.0)
    assert c.state("copy").gain == pytest.approx(3 / 1.1)  # no gain at 8 yet: batch 1's stands in
    for _ in range(40):
        _chain_step(c, [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], key="copy", verify_time=1.6,
                    draft_time=0.0)
    assert c.state("copy").gain < 1 and ask(c, "copy") == 0
    c.set_batch(7)
    assert c.state("copy").gain < 1  # 7 rows start from 8's
    c.set_batch(1)
    assert c.state("copy").gain == pytest.approx(3 / 1.1) and ask(c, "copy") > 0


def test_a_new_draft_class_at_a_batch_starts_with_a_one_token_probe():
    c = _cost_aware()
    c.update([0], [0], verify_time=1.0)
    assert ask(c, key=3) == 4  # batch 1: the whole initial length (a 5-row verify costs ~a step)
    c.set_batch(8)
    c.update([0] * 8, [0] * 8, verify_time=1.0)
    assert ask(c, key=2) == 1  # batch 8: 8 x 5 rows would cost ~4 steps before alpha is known
    assert ask(c, "tree", 16, tree=True) == 1  # and a tree drafter: one node per row, not 8 x 17 rows
    c.set_batch(1)
    assert ask(c, "tree", 16, tree=True) == 16  # batch 1: the drafter's own size


def test_at_a_batch_the_length_rule_counts_only_the_rows_that_draft():
    """Batch 8: a class whose draft covers 2 of 8 rows, every drafted token accepted. Per drafting row
    a 3-token chain yields 4 tokens, but per row of the batch 1 + 3 x 2/8 = 1.75 in the 4-row step's
    1.6 plain steps: a one-token draft (1 + 2/8 = 1.25 in 1.1 steps) is the best, where the
    drafting rows alone would have priced 3 tokens (4 / 1.6 = 2.5 against 2 / 1.1). At batch 1 the
    share does not apply."""
    c = _cost_aware(initial=3, maximum=3)
    c.set_batch(8)
    for q, t in ((1, 1.0), (2, 1.1), (3, 1.35), (4, 1.6)):
        c.update([q - 1] * 8, [0] * 8, verify_time=t)  # the batch's verify times per block size
    c.classes.clear()
    for _ in range(4):
        _chain_step(c, [3, 3, 0, 0, 0, 0, 0, 0], [3, 3, 0, 0, 0, 0, 0, 0], verify_time=1.6, draft_time=0.0)
    st = c.state()
    assert st.row_share == pytest.approx(0.25) and st.alpha == 1.0
    assert c.best_length(3) == 1
    st.row_share = None  # as before the share was measured: every row counted as drafting
    assert c.best_length(3) == 3


def test_a_new_run_at_a_batch_keeps_measured_classes_measured():
    """At batch 1 a new answer re-tries every class (its gain weighs min_samples - 1 steps); at a batch
    a retry verifies B rows per drafted token (EAGLE's first draft also feeds B prompts through its
    head), so a class measured as not paying stays judged and only its probes re-measure it."""
    c = _cost_aware(explore_every=3)
    c.set_batch(8)
    c.update([0] * 8, [0] * 8, verify_time=1.0)
    for _ in range(c.config.min_samples):
        _chain_step(c, [1] * 8, [0] * 8, verify_time=2.0, draft_time=0.0, key="k")
    c.new_run(8)
    assert c.state("k").gain_samples == c.config.min_samples
    assert take(c, c.choose(["k"], c.plan)).size == 0  # not paying, not fresh: no draft
    c.new_run(1)
    assert c.state("k").gain_samples == c.config.min_samples - 1  # batch 1: tried again


def test_bass_schedule_on_a_scripted_acceptance_trace():
    """BASS as published: l0 = 7, +2 after a step where some sequence took its whole draft, else cut
    ceil(l / 10) plus one per consecutive cut, never below the step's best accepted count; cap 32."""
    c = DraftLengthController(DraftLengthConfig.bass())
    trace = [([7, 7], [7, 2]), ([9, 9], [9, 0]), ([11, 11], [3, 1]), ([9, 9], [2, 0]), ([7, 7], [6, 6]),
             ([6, 6], [6, 1])]
    lengths = [ask(c)]
    for drafted, accepted in trace:
        c.update(drafted, accepted)
        lengths.append(ask(c))
    # 11 -> 11 - 2 = 9; 9 -> 9 - (1 + 1) = 7; 7 -> 7 - (1 + 2) = 4, floored at the 6 accepted
    assert lengths == [7, 9, 11, 9, 7, 6, 8]
    for _ in range(20):
        k = ask(c)
        c.update([k], [k])
    assert ask(c) == 32


def _tree_controller(step_times: dict[int, float]) -> DraftLengthController:
    c = _cost_aware()
    for q, t in sorted(step_times.items()):
        c.update([q - 1], [0], verify_time=t, draft_time=0.0 if q > 1 else None)
    c.state().gain, c.state().gain_samples = None, 0  # the calibration steps accepted nothing: forget them
    return c


def test_tree_budget_follows_measured_acceptance_and_verify_cost():
    """Sequoia's budget from measured acceptance (the first chain accepted 3, 8, 6, 8 deep in turn; the
    second never): a verify that costs a step up to 17 rows takes every node that adds value (8) and
    one untried node past them (``sequoia.one_step_beyond``: a 9th level assumed as good as the 8th,
    so the budget can grow when it would pay); one that costs 30% more per row stops at 6, before the
    nodes accepted only half the time."""
    wide = [-1, 0, 1, 2, 3, 4, 5, 6, -1, 0, 1, 2, 3, 4, 5, 6]  # two chains of 8: ranks 0 and 1 at depth 1
    cheap = _tree_controller({1: 1.0, **{q: 1.0 for q in range(2, 18)}})
    dear = _tree_controller({1: 1.0, **{q: 1.0 + 0.3 * (q - 1) for q in range(2, 18)}})
    for c in (cheap, dear):
        assert ask(c, cap=16, tree=True) == 16  # no tree seen yet: the drafter's own size
        for i in range(40):
            c.observe_tree([wide], [list(range([3, 8, 6, 8][i % 4]))])  # the first chain, 3-8 deep
        c.update([16], [5], verify_time=c.step_time[17], draft_time=0.0)
    big, small = ask(cheap, cap=16, tree=True), ask(dear, cap=16, tree=True)
    assert (big, small) == (9, 6)
    assert ask(cheap, cap=4, tree=True) <= 4  # never past the cap (the tokens still wanted)


def test_period_sweep_times_every_period_and_the_models_choice():
    from specdec.bench.period import sweep

    rows = sweep([96], [2], periods=(8, 32), n=24, rows=3, repeats=1)
    (row,) = rows
    assert row["best"] in (8, 32) and row["model"] in row["us_per_token"] and row["model"] >= 64
    assert row["model_vs_best"] > 0 and set(row["us_per_token"]) == {8, 32, row["model"]}


def test_one_slow_step_moves_a_verify_time_estimate_at_most_ten_percent():
    """A step that paid a store reallocation or a machine stall (10x) must not make a block size look
    dear for the rest of a session; a lasting change still comes through, step by step."""
    c = _cost_aware()
    c.update([0], [0], verify_time=1.0)
    c.update([1], [0], verify_time=1.0)
    c.update([1], [0], verify_time=10.0)
    assert c.step_time[2] == pytest.approx(1.1)
    for _ in range(30):
        c.update([1], [0], verify_time=3.0)
    assert c.step_time[2] == pytest.approx(3.0, rel=0.01)


def test_draft_cost_is_timed_per_size_and_fitted_to_a_line_between():
    """An EAGLE-like drafter pays a head forward per level, whatever its nodes: timed at 1 and 2 nodes
    (0.1, 0.15 of a step), the fitted line prices 8 nodes at 0.45, where a per-node price from the
    2-node trees would say 0.6, and Sequoia's budget grows; a drafter that pays a forward per token
    (self-speculation) is priced per token."""
    from specdec.controller import cost, sequoia

    c = _cost_aware(retree_every=10**9)
    c.update([0], [0], verify_time=1.0)
    assert c.draft_cost(3, "tree") == pytest.approx(3 * c.draft_time)  # nothing timed: per token
    c.update([2], [1], verify_time=1.0, draft_time=0.15, key="tree")
    assert c.draft_cost(8, "tree") == pytest.approx(0.6)  # one size timed: through the origin
    c.update([1], [1], verify_time=1.0, draft_time=0.1, key="tree")
    assert c.draft_cost(8, "tree") == pytest.approx(0.05 + 8 * 0.05)
    assert c.draft_cost(2, "tree") == pytest.approx(0.15)  # a timed size: its own mean
    c.step_time.update({q: 1.0 for q in range(2, 10)})  # every verify up to 9 rows costs a plain step
    st = c.state("tree")  # a measured table whose values grow with nodes
    st.values = sequoia.best_trees([[0.6, 0.2], [0.6, 0.2], [0.6], [0.6]], 16)[0]
    st.positions.observed = 1
    per_node = cost.best_budget(st.values[:9], lambda q: 1.0, lambda n: 0.075 * n)
    assert ask(c, "tree", 8, tree=True) > per_node
    for k in (1, 2, 3):
        c.update([k], [k], verify_time=1.0, draft_time=0.7 * k, key="self")
    assert c.draft_cost(6, "self") == pytest.approx(4.2)


def test_a_budget_search_prices_blocks_as_cost_ratio_does():
    """The table a budget search reads (``_verify_prices``, built once per search) gives every block
    size the nearest smaller timed size's seconds, as ``cost_ratio`` does; random timed sets."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        c = _cost_aware()
        c.step_time.update({q: rng.uniform(0.5, 3.0) for q in rng.sample(range(1, 20), rng.randint(1, 8))})
        c.step_time.setdefault(1, 1.0)
        prices = c._verify_prices(24)
        for q in range(1, 25):
            assert prices(q) == pytest.approx(c.cost_ratio(q) * c.step_time[1])


def test_a_block_of_fewer_rows_never_reads_as_dearer_than_a_bigger_one():
    """The 1-row time is measured on the first step (cold: 2x); every later step drafts, so without the
    clamp it would stand for the session and every drafted size would look cheap against it."""
    c = _cost_aware()
    c.update([0], [0], verify_time=2.0)
    c.update([3], [1], verify_time=1.1, draft_time=0.0)
    assert c.step_time[1] == c.step_time[4] == pytest.approx(1.1)
    c.update([1], [0], verify_time=1.0, draft_time=0.0)  # 2 rows cheaper still: 1 row follows
    assert c.step_time[1] == c.step_time[2] == pytest.approx(1.0) and c.step_time[4] == pytest.approx(1.1)


def test_a_step_that_grew_the_store_is_not_a_sample_of_its_verify_cost():
    c = _cost_aware()
    c.update([0], [0], verify_time=1.0, grew=True)  # no 1-row time yet: taken all the same
    c.update([0], [0], verify_time=1.5, grew=True)
    assert c.step_time[1] == pytest.approx(1.0)
    c.update([0], [0], verify_time=1.5)
    assert c.step_time[1] > 1.0


def test_a_cache_folder_is_built_once_by_processes_starting_together(tmp_path):
    """Two processes asking for an invalid cache at once: one builds it, the other waits and uses it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        from specdec import model_cache, models
        d = Path({str(tmp_path / 'cache')!r})
        def build():
            with open(Path({str(tmp_path)!r}) / 'builds', 'a') as f:
                f.write('x')
            time.sleep(1.0)
            d.mkdir(parents=True, exist_ok=True)
            w = d / 'model.safetensors'
            w.write_bytes(b'weights')
            (d / 'manifest.json').write_text(json.dumps(
                {{'format': model_cache.CACHE_FORMAT, 'size': 7, 'sha256': model_cache.sha256(w)}}))
        model_cache.ensure(d, build)
        assert model_cache.is_valid(d)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert (tmp_path / "builds").read_text() == "x"
