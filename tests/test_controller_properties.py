"""What the draft-length controller must do, whatever it recorded before (tests/controller_decisions.json
pins every decision; this file checks the ones that follow from its rules): the controller is driven
as the decoder drives it at batch 1 (ask for a draft, verify it, report the counts and seconds) over
simulated drafters whose tokens are each accepted with a fixed chance, with verify times that grow
with the block. Seeded: every run repeats.
"""

import random

import pytest

from controller_helpers import ask, take
from specdec.controller import DraftLengthConfig, DraftLengthController

def verify_cost(slope: float):
    """Verify seconds of a block of q rows: a plain step (1 s) plus ``slope`` s a drafted row."""
    return lambda q: 1.0 + slope * (q - 1)


FLAT = verify_cost(0.0)  # a memory-bound step: any small block costs a plain step
STEEP = verify_cost(0.5)  # each drafted row adds half a plain step


def chain(k: int) -> list[int]:
    return list(range(-1, k - 1))  # parents of a k-node chain


def decode(c: DraftLengthController, steps: int, rate, verify=FLAT, draft: float = 0.0, key=None,
           tree: int = 0, seed: int = 0) -> list[int]:
    """Drive ``c`` for ``steps`` steps at batch 1: each asks for a chain (``budget``) or, with ``tree`` > 0,
    a tree of up to ``tree`` nodes (``plan(tree=True)``; drafted as a chain), keeps its leading tokens
    while each passes with chance ``rate(step)``, and reports them with verify(1 + k) seconds and
    ``draft`` seconds a drafted token. Returns the sizes asked for."""
    rng = random.Random(seed)
    sizes = []
    for step in range(steps):
        k = ask(c, key, tree, tree=True) if tree else ask(c, key)
        accepted = 0
        while accepted < k and rng.random() < rate(step):
            accepted += 1
        c.update([k], [accepted], verify(1 + k), draft * k, key)
        if k:
            c.observe_tree([chain(k)], [list(range(accepted))], key)
        sizes.append(k)
    return sizes


def draws(sizes: list[int]) -> list[int]:
    """The steps that drafted something."""
    return [i for i, k in enumerate(sizes) if k > 0]


# ------------------------------------------------------------------------------ BASS's schedule

@pytest.mark.parametrize("shrink", ["one", "bass"])
def test_the_length_grows_after_a_whole_draft_and_shrinks_after_none_never_below_the_best_row(shrink):
    """Without the cost gate (BASS's schedule), over random steps of a batch of 3: a step where some row
    took its whole draft lengthens the next by ``step_up`` (to ``maximum``); any other drafting step
    shortens it, never below ``minimum`` nor below the most tokens a row accepted: by one token
    ("one"), or by at least n tokens at the n-th shrink in a row ("bass": BASS's ceil(l / 10) plus one
    per shrink before it); a step that drafted nothing leaves it."""
    config = DraftLengthConfig(cost_aware=False, shrink=shrink, initial=7, maximum=32)
    c = DraftLengthController(config)
    c.new_run(3)
    rng = random.Random(1)
    in_a_row = grew = shrank = 0
    for _ in range(400):
        k = ask(c)
        drafted = [rng.choice([0, k, k]) for _ in range(3)]
        accepted = [d if rng.random() < 0.3 else rng.randint(0, max(0, d - 1)) for d in drafted]
        c.update(drafted, accepted, 1.0, 0.0)
        n = ask(c)
        if not any(drafted):
            assert n == k
        elif any(d > 0 and a == d for d, a in zip(drafted, accepted)):
            assert n == min(config.maximum, k + config.step_up)
            in_a_row, grew = 0, grew + 1
        else:
            in_a_row, shrank = in_a_row + 1, shrank + 1
            floor = max(config.minimum, max(accepted))
            if shrink == "one":
                assert n == max(floor, k - 1)
            else:
                assert n == floor or floor < n <= k - in_a_row
    assert grew > 20 and shrank > 20  # both branches taken


def test_without_adaptation_the_length_is_fixed():
    c = DraftLengthController(DraftLengthConfig(cost_aware=False, adaptive=False, initial=4))
    sizes = decode(c, 50, lambda s: 0.5)
    assert set(sizes) == {4}


# ------------------------------------------------------------------------------ the cost-aware length

def test_a_class_whose_drafts_are_accepted_more_drafts_longer_chains():
    """Two draft classes on one controller, the verify cost growing with the block: the class whose
    tokens are accepted 90% of the time settles on longer chains than the one accepted 50%, and both
    keep drafting (each pays)."""
    c = DraftLengthController()
    often = decode(c, 300, lambda s: 0.9, verify_cost(0.05), key="often")
    seldom = decode(c, 300, lambda s: 0.5, verify_cost(0.05), key="seldom", seed=1)
    late = slice(200, None)
    assert min(often[late]) > 0 and min(seldom[late]) > 0
    assert sum(often[late]) > sum(seldom[late])
    assert min(often[late]) >= max(seldom[late])


def test_a_run_of_whole_drafts_lengthens_the_chain_to_the_maximum():
    """Every drafted token accepted, verify time flat, drafts free: each whole draft asks one token
    more (each longer block is timed as it is tried) until ``maximum``, and stays there."""
    config = DraftLengthConfig()
    sizes = decode(DraftLengthController(config), 60, lambda s: 1.0)
    assert sizes[-10:] == [config.maximum] * 10
    grown = sizes[1:sizes.index(config.maximum) + 1]
    assert all(b >= a for a, b in zip(grown, grown[1:]))  # never shorter on the way up


@pytest.mark.parametrize("tree", [0, 12])
def test_a_class_priced_out_stops_drafting_but_for_probes_spaced_ever_wider(tree):
    """Drafts never accepted while each drafted row costs half a plain step and drafting costs too: after
    ``min_samples`` judged steps the class drafts nothing but a probe now and then, each a single
    token (or node), the gaps between probes never narrowing, up to 8 x ``explore_every``."""
    config = DraftLengthConfig()
    sizes = decode(DraftLengthController(config), 600, lambda s: 0.0, STEEP, draft=0.2, tree=tree)
    drafting = draws(sizes)
    assert len(drafting) < 600 / config.explore_every  # off most of the time
    probes = drafting[config.min_samples:]  # past the drafting steps that measured the class
    assert probes and all(sizes[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and all(b >= a for a, b in zip(gaps, gaps[1:]))
    assert gaps[-1] >= 8 * config.explore_every


def test_a_probe_that_pays_turns_drafting_back_on():
    """Priced out first (nothing accepted), then every drafted token accepted: a probe finds it within
    8 x ``explore_every`` steps and from then on the class drafts at every step."""
    config = DraftLengthConfig()
    switch = 300
    sizes = decode(DraftLengthController(config), 500, lambda s: 0.0 if s < switch else 1.0, verify_cost(0.1),
                   draft=0.02)
    assert len(draws(sizes[:switch])) < switch / config.explore_every
    back = next(i for i in draws(sizes) if i >= switch)
    assert back - switch <= 8 * config.explore_every + 1
    assert all(k > 0 for k in sizes[back + 5:])


def test_a_new_run_keeps_what_was_measured():
    """A new answer restarts the schedules, not the measurements: a class measured to pay at the longest
    chains drafts them from the answer's first step (not BASS's initial length); a class priced out
    drafts once, a single token (each class drafts at least once an answer), then only probes."""
    config = DraftLengthConfig()
    sure = DraftLengthController(config)
    decode(sure, 60, lambda s: 1.0)
    sure.new_run(1)
    assert decode(sure, 3, lambda s: 1.0) == [config.maximum] * 3
    off = DraftLengthController(config)
    decode(off, 300, lambda s: 0.0, STEEP, draft=0.2)
    off.new_run(1)
    sizes = decode(off, 100, lambda s: 0.0, STEEP, draft=0.2, seed=3)
    once, then = draws(sizes)[:2]
    assert sizes[once] == 1 and then - once >= config.explore_every


# ------------------------------------------------------------------------------ several sources

def choose_steps(c: DraftLengthController, steps: int, rates: dict) -> list:
    """Drive ``c`` choosing among the sources of ``rates`` (source -> chance a drafted token is accepted)
    at every step (``choose``, the plan taken), as the decoder drives a chooser at batch 1; returns the source that drafted at each
    step (None: nothing drafted)."""
    rng = random.Random(0)
    picks = []
    for _ in range(steps):
        plan = take(c, c.choose(list(rates), c.plan))
        key, k = plan.key, plan.size
        accepted = 0
        while accepted < k and rng.random() < rates.get(key, 0.0):
            accepted += 1
        c.update([k], [accepted], verify_cost(0.1)(1 + k), 0.01 * k, key)
        if k:
            c.observe_tree([chain(k)], [list(range(accepted))], key)
        picks.append(key if k else None)
    return picks


def test_the_source_that_pays_most_drafts_and_another_that_pays_gets_a_turn_when_due():
    """Two sources that both pay, one more: once each is measured (``min_samples`` drafting steps) the
    better one drafts, and the other gets one turn each time it has been passed over ``revisit_every``
    steps (its gain may be stale), no sooner and no later."""
    config = DraftLengthConfig(revisit_every=32)
    picks = choose_steps(DraftLengthController(config), 400, {"sure": 1.0, "fair": 0.6})
    fair = [i for i, p in enumerate(picks) if p == "fair"][config.min_samples:]
    assert len(fair) > 5 and all(b - a == config.revisit_every + 1 for a, b in zip(fair, fair[1:]))
    assert all(p == "sure" for i, p in enumerate(picks) if i > fair[0] and i not in fair)


def test_a_source_that_never_pays_drafts_only_as_a_rare_probe_beside_one_that_does():
    """A source whose drafts are never accepted, beside one whose are always: after the first steps the
    first drafts no more than a probe every ``explore_every`` steps; every other step the second drafts."""
    config = DraftLengthConfig(revisit_every=32)
    picks = choose_steps(DraftLengthController(config), 400, {"sure": 1.0, "never": 0.0})
    late = picks[100:]
    assert late.count("never") <= len(late) / config.explore_every
    assert late.count("sure") >= len(late) - late.count("never")
