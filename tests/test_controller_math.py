"""The controller's pure parts on hand-made tables: the worked examples of their docstrings hold."""

import pytest

from controller_helpers import ask_batch
from specdec.controller import chooser, cost, policies
from specdec.controller.tables import ClassState, VerifyTimes, nearest_batch, running_mean, running_time


def test_a_slow_sample_moves_a_time_estimate_by_at_most_half_its_weight():
    assert running_mean(1.0, 2.0, 0.8) == pytest.approx(1.2) and running_mean(None, 2.0, 0.8) == 2.0
    assert running_time(1.0, 5.0, 0.8) == pytest.approx(1.1)  # clipped at 1.5x: 0.8 + 0.2 x 1.5


def test_the_nearest_batch_size_is_nearest_on_a_log_scale_ties_to_the_larger():
    assert nearest_batch({1, 8}, 2) == 1 and nearest_batch({1, 8}, 3) == 8 and nearest_batch({2, 8}, 4) == 8
    assert nearest_batch([], 2) is None


def test_fewer_verify_rows_never_read_as_dearer_and_store_growth_is_no_sample():
    t = VerifyTimes()
    t.live.update({1: 1.3, 2: 1.1})
    t.record(4, 1.1, grew=False, decay=0.8)
    assert t.live == {1: 1.1, 2: 1.1, 4: 1.1}
    t.record(4, 9.0, grew=True, decay=0.8)  # a reallocation step: not a sample of q = 4
    assert t.live[4] == 1.1
    assert VerifyTimes().probe_table(1) is None  # no 1- and 2-row times anywhere yet
    t.select(8)
    assert t.live == {} and t.probe_table(8) is t.by_batch[1]  # an untimed batch: the nearest timed one's


def test_a_class_takes_the_gain_of_the_nearest_measured_batch_size():
    st = ClassState(initial=3, explore_every=8, tree_decay=0.98)
    st.gain, st.gain_samples = 2.1, 4
    st.switch_batch(1, 8)
    assert (st.gain, st.gain_samples) == (2.1, 4)  # 8 unmeasured: batch 1's stands in
    st.gain = 0.9
    st.switch_batch(8, 6)
    assert st.gain == 0.9  # 6 is nearer 8 than 1
    st.switch_batch(6, 1)
    assert st.gain == 2.1


def test_a_gain_is_the_plain_mean_of_the_first_steps():
    st = ClassState(initial=3, explore_every=8, tree_decay=0.98)
    st.add_gain(0.5, 0.95)
    st.add_gain(2.0, 0.95)
    assert st.gain == pytest.approx(1.25) and st.gain_samples == 2


def test_price_tables_and_gains_by_hand():
    verify = cost.verify_prices({1: 1.0, 4: 1.2}, 5)
    assert [verify(q) for q in range(1, 6)] == [1.0, 1.0, 1.0, 1.2, 1.2]
    assert cost.draft_prices({1: 0.002, 2: 0.003}, 0.0)(6) == pytest.approx(0.007)
    assert cost.draft_prices({2: 0.004}, 0.0)(6) == pytest.approx(0.012)
    assert cost.draft_prices({}, 0.5)(3) == 1.5
    assert cost.probe_cost({1: 1.0, 2: 2.2}) == pytest.approx(1.2) and cost.probe_cost({1: 1.0, 2: 0.9}) == 0.0
    assert cost.probe_spacing(1.2, 0.0, 0.02) == 60
    assert cost.step_gain(4, 1, 2.0, 1.0) == 2.0 and cost.shadow_gain(3.0, 1.2, 0.0, 1.0) == pytest.approx(2.5)
    assert cost.per_row([0.0, 0.8], 0.5) == [0.0, 0.4]
    assert cost.best_budget([0, 0.8, 0.9, 0.9], [0, 1.0, 1.0, 1.3, 1.3].__getitem__, lambda n: 0.0) == 1


def test_bass_grows_after_a_whole_draft_and_shrinks_otherwise():
    assert policies.next_length(5, 0, [5, 5], [5, 2], 1, 10, 2, bass=False) == (7, 0)
    assert policies.next_length(5, 0, [5, 5], [3, 2], 1, 10, 2, bass=False) == (4, 1)
    assert policies.next_length(25, 1, [25], [0], 1, 32, 2, bass=True) == (21, 2)  # ceil(2.5) + 1
    assert [policies.bass_shrink(25, 0), policies.bass_shrink(22, 1)] == [3, 4]


def test_the_measured_gain_has_the_last_word_on_the_length():
    assert policies.pays(0.9, 2, 3) and not policies.pays(0.9, 3, 3) and policies.pays(None, 0, 3)
    assert policies.gain_floor(0, 1.2) == 1 and policies.gain_floor(0, 0.9) == 0
    # a gain not judged yet (too few steps): a token, as a tree's gate drafts a node then
    assert policies.gain_floor(0, 0.3, judged=False) == 1 and policies.gain_floor(0, None, judged=False) == 0
    assert policies.gain_floor(4, 0.3) == 4
    assert policies.past_whole(3, 3, 4, 1, 10) == 5 and policies.past_whole(3, 3, 2, 1, 10) == 3
    assert policies.past_whole(3, 3, 4, 8, 10) == 3 and policies.past_whole(3, 0, 4, 1, 10) == 3
    assert (policies.probe_size(8, 3), policies.probe_size(1, 3), policies.probe_size(1, 3, n=2)) == (1, 3, 2)
    assert policies.next_probe_length(1, True, [1], 10, 2) == 3
    assert policies.next_probe_length(3, False, [1], 10, 2) == 1


def test_sources_are_asked_fresh_first_then_due_then_by_gain():
    def state(gain, samples, idle=0):
        st = ClassState(initial=3, explore_every=8, tree_decay=0.98)
        st.gain, st.gain_samples, st.idle = gain, samples, idle
        return st

    states = {"a": state(1.4, 5), "b": state(1.1, 5), "c": state(None, 0), "d": state(0.8, 5, idle=64)}
    keys = list(states)
    assert chooser.ask_order(keys, states, (), 3, 64) == (["c"], ["d"], ["a", "b"])
    assert chooser.ask_order(keys, states, ("c",), 3, 64) == ([], ["d"], ["a", "b", "c"])
    said = {"a": 0, "b": 2}
    states["a"].idle = 5
    pick = chooser.choose(["a", "b"], {k: states[k] for k in "ab"}, said.get, (), 3, 64,
                          lambda st: policies.pays(st.gain, st.gain_samples, 3))
    assert pick == ("b", 2, ["a", "b"]) and states["a"].idle == 5  # the classes asked; the caller resets them


def test_a_batch_whose_cost_grows_as_fast_as_its_rows_drafts_nothing_but_a_periodic_retime():
    from specdec.controller import DraftLengthConfig, DraftLengthController
    from specdec.drafters.chooser import draft_step

    c = DraftLengthController(DraftLengthConfig(retime_every=4))
    c.times.by_batch[16] = {1: 0.10, 2: 0.21}  # 2 rows a sequence cost 2.1x: even a sure draft loses
    c.times.by_batch[4] = {1: 0.10, 2: 0.12}  # a sure draft of 1 node: 2 / 1.2 = 1.67x, worth trying
    c.times.by_batch[1] = {1: 0.10, 2: 0.50}  # batch 1 is the per-class gate's alone
    c.set_batch(16)
    assert all(c.priced_out() for _ in range(8))  # a question alone counts nothing toward the re-timing
    assert [ask_batch(c) for _ in range(8)] == [True, True, True, False] * 2  # plans taken: every 4th drafts
    for b in (4, 1):
        c.set_batch(b)
        assert not any(ask_batch(c) for _ in range(8))
    c.set_batch(16)
    c.times.live[3] = 0.25  # a 3-row block timed cheaper per row (3 x 0.10 / 0.25 = 1.2): worth trying again
    assert not ask_batch(c)
    off = DraftLengthController(DraftLengthConfig(cost_aware=False))  # fixed drafts are never priced out
    off.times.by_batch[16] = {1: 0.10, 2: 0.30}
    off.set_batch(16)
    assert not ask_batch(off)

    class Asked:  # a chooser that must not be asked while the batch is priced out
        def choose(self, *a):
            raise AssertionError("asked")

    c.times.live.pop(3)
    c._priced_out_steps = 0
    key, tree, shadows = draft_step(Asked(), c, 16, wanted=8, shadow=True)
    assert key is None and tree.width == 0 and tree.tokens.shape[0] == 16 and shadows == []


def test_drafting_steps_at_a_batch_are_judged_together_from_the_nearest_well_measured_size():
    from specdec.controller import DraftLengthConfig, DraftLengthController
    from specdec.controller.tables import BatchGains

    g = BatchGains()
    for gain in (0.8, 1.0, 0.9):
        g.add(8, gain, 0.95)
    g.add(16, 1.2, 0.95)
    assert g.by_batch[8] == (pytest.approx(0.9), 3) and g.near(16, 3) == pytest.approx(0.9)
    assert g.near(16, 1) == 1.2 and g.near(4, 4) is None

    c = DraftLengthController(DraftLengthConfig(retime_every=4, batch_samples=3))
    c.times.by_batch[8] = {1: 0.10, 2: 0.12}  # a sure 1-node draft would pay: the ceiling alone says draft
    c.set_batch(8)
    for _ in range(3):  # 1.5 tokens a row of 8 in 1.6 plain steps: 0.94x, whatever the class
        c.update([1] * 8, [1] * 4 + [0] * 4, verify_time=0.15, draft_time=0.01, key=("lookup", len(c.batch_gains.by_batch)))
    assert c.batch_gains.by_batch[8][1] == 3 and c.batch_gains.by_batch[8][0] < 1
    assert [ask_batch(c) for _ in range(4)] == [True, True, True, False]
    c.set_batch(1)
    c.update([1], [1], verify_time=0.15, draft_time=0.01)  # batch 1: its own class gate, not pooled
    assert 1 not in c.batch_gains.by_batch and not ask_batch(c)
