"""Draft-length control: how many tokens to ask the drafter for at the next step.

Verification is not free on a CPU: with specdec.runtime.kernels a default-model forward over 2 tokens costs
what 1 does, over 3-8 ~1.15x, over 12 ~1.45x, over 16 ~1.7x. So drafting pays only while enough of
it is accepted, and only as much of it as the measured cost curve allows. Two rules:

- BASS (Qian et al., 2024) sets the length K: grow by ``step_up`` after a step where some sequence
  accepted the whole draft, otherwise shrink by one, never below the best count accepted then.
- Cost-aware gating (``cost_aware``) picks the length itself, up to ``maximum``, if any, once the
  class's acceptance is measured (its first draft takes BASS's initial length; capped by BASS's K,
  which shrinks after every miss, the gate could not use 6-row verifies that cost what 2 rows
  do: prompt lookup then ran 6% behind a fixed 5-token draft). It keeps an estimate of
  the acceptance per draft depth and of the verify time per block size q = 1 + k, both
  measured, and of the drafter's seconds d(k) per draft size; it drafts the k <= maximum with the most expected
  tokens per unit of time, (1 + a1 + a1 a2 + ... + a1...ak) / ((t(1 + k) + d(k)) / t(1)), or nothing
  when no k beats plain decoding. The a_i are the measured acceptance at depth i given depth i - 1
  was accepted (a chain is a tree of one rank: the same table as Sequoia's below), not one alpha:
  copied chains that match once go on matching (0.37 at depth 1, ~0.9 from depth 6 on Spec-Bench),
  and the geometric 1 + alpha + ... + alpha^k with alpha ~0.5 stopped prompt lookup's drafts at ~3
  tokens where 7 paid (the controller ran 5% behind a fixed 7-token draft).
  While drafting is off, a probe every ``explore_every`` steps (doubling while probes fail, up to
  8x) keeps acceptance current (text changes: a summary starts quoting its source): one token per
  row at a batch; at batch 1 one token, two more after each probe taken whole (so deeper depths are
  re-measured too). A probe whose step paid restarts the gain's measurement. While the measured
  gain says drafting pays, at least a token is drafted, whatever the table predicts.

Drafters that size their own drafts (EAGLE-2 trees rank nodes by draft score) skip the length rule
and take ``gate``: draft while a drafting step's measured gain (tokens it yields per sequence over its
draft + verify seconds, in units of a plain step of the same batch size) beats 1, else decode
plainly and probe on the same schedule. The same measured gain also vetoes the length rule's
prediction (``budget``), which at a batch counts every row as drafting.
That is MagicDec's choice of drafter, between this drafter and none, made from live timings.
With several sources (``drafters.auto``) ``choose`` first picks the class with the best measured
gain among those that can draft now and whose own rule drafts something; the free sources' classes
not chosen are measured too, from drafts scored but never verified (``observe_shadow``). When the
gate is open, ``tree_budget`` sizes the tree (Sequoia, specdec.controller.sequoia): from the acceptance per
depth and sibling rank measured on the trees verified so far, the node budget with the most expected
tokens per second given the verify times of this batch size (more nodes where a verify is cheap
relative to a step, fewer where it is not).

At batch B > 1 one verify runs B x (1 + k) rows, so its cost curve is the batch's own: step times
and each class's measured gain are kept per batch size (``set_batch``; the live batch shrinks as
sequences finish), and the same rule then stops drafting when B x (1 + k) rows cost more than the
accepted tokens win; the tokens a draft wins are counted per row of the batch, from the measured
share of rows that get a draft in the class (``_per_row``). BASS's own schedule
(``DraftLengthConfig.bass()``: start at 7, +2 up to 32, shrink by ceil(l / 10) plus one per
consecutive shrink, never below the step's best accepted count) is a selectable policy without the
cost gate, as in the paper.

The controller belongs to its ``SpecDecoder`` and outlives one ``generate``: the machine's verify
times, each draft class's acceptance and measured gain carry over to the next answer (``new_run``
resets only the per-answer schedules), so an answer does not start by re-learning what the last
one measured (a chat turn, a benchmark's next question, a server's next request).

Acceptance is kept per *draft class*, a key the drafter gives before each step (``Drafter.
draft_class``): prompt lookup's class is the length of the n-gram it matched, because a 3-gram match
is copied far more reliably than a 1-gram one; one rate for both would gate off the good matches
with the bad. Each class has its own alpha, BASS length and probe schedule; verify and draft costs
are the machine's and are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Collection, Hashable

from specdec.controller import sequoia
from specdec.tree import subtree_depth


@dataclass(frozen=True)
class DraftLengthConfig:
    initial: int = 3  # first draft length: 4 verify rows (cost about what 1 does, specdec.runtime.kernels)
    minimum: int = 1  # never ask for fewer (0 would turn drafting off for good)
    maximum: int = 10  # past ~10 tokens a CPU verify forward costs more than it can win
    step_up: int = 2  # BASS: +2 after a step where some sequence accepted everything
    adaptive: bool = True  # False: always ask for `initial`
    cost_aware: bool = True  # draft only when expected gain beats the measured verify cost
    explore_every: int = 8  # while gated off, probe one token every n steps (backs off to 8n)
    # ...and never more often than keeps probes' extra verify cost under this share of the run: at
    # batch 8 a one-token probe verifies 16 rows, ~2.2x a plain step, so probes come every >= 60 steps
    probe_share: float = 0.02
    decay: float = 0.8  # weight of the past in the running averages (alpha, verify times)
    # the measured gain per drafting step: a long memory (~20 steps), because one step yields 1, 2
    # or 3 tokens and a short average near break-even would close the gate on noise
    gate_decay: float = 0.95
    shrink: str = "one"  # after a step with no whole draft accepted: "one" token, or "bass" (see bass_shrink)
    tree_decay: float = 0.98  # trees: weight of the past per observed tree in the depth x rank acceptance
    retree_every: int = 16  # trees: re-run Sequoia's program after this many observed trees
    revisit_every: int = 64  # several sources: a candidate passed over this many steps gets a turn
    # a class drafts until this many of its drafting steps are measured before its gain is judged,
    # and with several sources it is chosen first until then (one step is noise: an answer's first
    # 1-gram copy missed, and auto never chose prompt lookup again)
    min_samples: int = 3
    tree_nodes: int = 0  # > 0 with cost_aware off: a fixed tree budget (a sweep's fixed setting)

    @classmethod
    def bass(cls, **overrides) -> "DraftLengthConfig":
        """BASS's schedule as published: l0 = 7, +2 up to 32, ceil(l/10) shrinks, no cost gate."""
        return replace(cls(initial=7, maximum=32, step_up=2, shrink="bass", cost_aware=False), **overrides)


def bass_shrink(length: int, consecutive: int) -> int:
    """BASS's cut after a step in which no sequence accepted its whole draft: ceil(l / 10), plus one
    for each shrink just before this one. Example: l = 25 -> 3, then (l = 22) 3 + 1 = 4, then 3 + 2."""
    return math.ceil(length / 10) + consecutive


def _running_mean(old: float | None, sample: float, decay: float) -> float:
    """An exponentially decayed mean: the first sample as it is (old None), then decay * old +
    (1 - decay) * sample."""
    return sample if old is None else decay * old + (1 - decay) * sample


def _running_time(old: float | None, sample: float, decay: float) -> float:
    """A running mean of seconds in which a sample counts at most 1.5x the estimate: one step that
    paid a store reallocation, an EAGLE catch-up or a stall of the machine moves it <= 10% (seen: a
    2-row verify's estimate left at 2.3x a plain step for the rest of a session, as 2-row blocks were
    not drafted again to correct it); a lasting change still comes through, step by step."""
    return sample if old is None else _running_mean(old, min(sample, 1.5 * old), decay)


class _ClassState:
    """What the controller has learned about one draft class."""

    __slots__ = ("alpha", "length", "skipped", "interval", "gain", "gain_samples", "shrinks", "positions",
                 "values", "idle", "draft_by_size", "probing", "probe_length", "whole", "shadowed",
                 "row_share", "catch_up", "gains")

    def __init__(self, config: DraftLengthConfig) -> None:
        # per-token acceptance rate (accepted over judged drafts, a summary), None until measured
        self.alpha: float | None = None
        # running mean measured gain of a drafting step over a plain step of the same batch: tokens per
        # sequence it yields over its draft + verify seconds in plain-step units; None until measured
        self.gain: float | None = None
        self.gain_samples = 0  # drafting steps measured: their plain mean until the EMA's memory is reached
        # (gain, gain_samples) of the other batch sizes: the two above are the live batch's (set_batch)
        self.gains: dict[int, tuple[float | None, int]] = {}
        self.length = config.initial  # BASS draft length
        self.skipped = 0  # steps gated off since the last draft
        self.interval = config.explore_every  # steps between probes; doubles while probes fail
        self.shrinks = 0  # consecutive steps the length shrank (BASS's schedule cuts more each time)
        # trees: acceptance per depth and sibling rank, and Sequoia's best value per node budget
        # (recomputed every ``retree_every`` observed trees)
        self.positions = sequoia.PositionalAcceptance(decay=config.tree_decay)
        self.values: list[float] | None = None
        self.idle = 0  # steps this class was a candidate (``choose``) and another was picked
        # running mean seconds of a whole draft per size drafted (nodes, the longest row's), the class's
        # own (``draft_cost``): a prompt-lookup draft costs ~0, a self-speculation token a forward, an
        # EAGLE tree a head forward per level, not per node (per-token prices from small trees
        # overpriced big ones: the controller drafted 1-2 nodes where a fixed 6 was 5% faster)
        self.draft_by_size: dict[int, float] = {}
        self.probing = False  # the step being drafted is a probe (the gate or the length rule said no)
        self.probe_length = 1  # a chain probe's length at batch 1: +step_up after one taken whole
        self.whole = 0  # the length of the last draft if it was taken whole (every row), else 0
        self.shadowed = False  # this run scores unverified drafts of the class (observe_shadow)
        # at a batch: the running share of rows that got a draft in this class's drafting steps (prompt
        # lookup's class is the longest match over the rows; the rows without one draft nothing and
        # still pay for the others' verify rows); None until a batch drafted in the class
        self.row_share: float | None = None
        # running mean seconds the source spent catching up when it drafted after a pause (EAGLE's
        # head feeding the prompt and the skipped tokens: ~0.2 s at B = 8): part of a probe's cost
        self.catch_up = 0.0


class DraftLengthController:
    def __init__(self, config: DraftLengthConfig = DraftLengthConfig()) -> None:
        if not 0 <= config.minimum <= config.initial <= config.maximum:
            raise ValueError(f"need 0 <= minimum <= initial <= maximum, got {config}")
        self.config = config
        self.classes: dict[Hashable, _ClassState] = {}
        self._step_times: dict[int, dict[int, float]] = {1: {}}  # batch size -> (q -> seconds)
        self.step_time: dict[int, float] = self._step_times[1]  # the live batch's: q -> mean verify seconds
        self.batch_size = 1
        # running mean seconds per drafted token over every class: the price of a class that has not
        # drafted yet (``draft_cost``)
        self.draft_time: float = 0.0

    def new_run(self, batch_size: int) -> None:
        """A new ``generate`` call: keep what was measured (verify times, acceptance, draft times, gains
        at a reduced weight), restart the per-answer schedules (BASS's length, probe spacing, which
        classes are shadowed; a source's turn comes after ``revisit_every`` passed-over steps
        whichever answer they fell in). Without the cost gate nothing measured steers the drafts,
        so a seeded sampling run repeats."""
        self.set_batch(batch_size)
        for st in self.classes.values():
            st.length, st.shrinks = self.config.initial, 0
            st.skipped, st.interval, st.probe_length, st.shadowed = 0, self.config.explore_every, 1, False
            # a new text: the measured gain weighs as min_samples - 1 steps, so each class drafts at
            # least once in this answer and its first steps here move the gain a third, a quarter, ...
            # (a gain carried at full weight from an answer where EAGLE lost kept its gate shut
            # through a qa answer where it won 25%). Not at a batch: there a retry verifies B rows per
            # drafted token and EAGLE's first draft feeds B prompts through its head (0.2-0.5 s at B = 8,
            # 4-8 plain steps, in every run); probes, a token per row, re-measure a class there
            if batch_size == 1:
                st.gain_samples = min(st.gain_samples, self.config.min_samples - 1)

    def set_batch(self, batch_size: int) -> None:
        """The live batch size changed (sequences finished): verify costs are that batch's own, and so
        is each class's measured gain; a batch size not measured yet starts from the nearest measured
        one's. One gain for every size let the last steps of a batch-8 run, at 1-3 rows where a copy
        pays, hold the gate open at 8 rows where the same drafts lost (gain 0.83-0.86: ``auto`` 7%
        behind prompt lookup; the Xeon, 2026-11-25)."""
        if batch_size < 1:
            return  # every row finished: the next run sets its own
        if batch_size != self.batch_size:
            for st in self.classes.values():
                st.gains[self.batch_size] = (st.gain, st.gain_samples)
                measured = [b for b, (g, _) in st.gains.items() if g is not None]
                near = min(measured, key=lambda b: (abs(math.log(b / batch_size)), -b), default=None)
                st.gain, st.gain_samples = st.gains[near] if near is not None else (None, 0)
        self.step_time = self._step_times.setdefault(batch_size, {})
        self.batch_size = batch_size

    def probe_cost(self) -> float:
        """A one-token probe's verify time over a plain step's, minus 1, at the live batch, or at the
        nearest batch size where both were timed (a batch that just lost a row costs about the same);
        0 before any were timed. Example: t(q=2) = 2.2 s, t(q=1) = 1 s at batch 8 -> 1.2."""
        timed = [b for b, t in self._step_times.items() if 1 in t and 2 in t]
        if not timed:
            return 0.0
        t = self._step_times[min(timed, key=lambda b: (abs(math.log(b / self.batch_size)), -b))]
        return max(0.0, t[2] / t[1] - 1.0)

    def state(self, key: Hashable = None) -> _ClassState:
        if key not in self.classes:
            self.classes[key] = _ClassState(self.config)
        return self.classes[key]

    @property
    def alpha(self) -> float | None:
        """The default class's acceptance rate (a drafter without classes has only that one)."""
        return self.state().alpha

    @alpha.setter
    def alpha(self, value: float | None) -> None:
        self.state().alpha = value

    @property
    def length(self) -> int:
        return self.state().length

    def draft_cost(self, n: int, key: Hashable = None) -> float:
        """Seconds to draft n nodes in class ``key``: the size's own running mean if it was timed, else
        the line a + b n fitted to the timed sizes (least squares, a, b >= 0: EAGLE pays a head
        forward per level, so a is large and b small; self-speculation pays a forward per token, a ~0),
        through the origin from one timed size, n x the per-token mean over every class before any.
        Example: timed {1: 2 ms, 2: 3 ms} -> n = 6: 1 + 6 x 1 = 7 ms; timed {2: 4 ms} -> n = 6: 12 ms."""
        return self._draft_prices(key)(n)

    def _draft_prices(self, key: Hashable = None) -> Callable[[int], float]:
        """``draft_cost`` of class ``key`` as a function of n, the line fitted once: a budget search
        prices up to 32 sizes a step, and refitting for each was ~0.2 ms of a ~25 ms step."""
        sizes = self.state(key).draft_by_size
        if not sizes:
            per_token = self.draft_time
            return lambda n: n * per_token
        if len(sizes) == 1:
            (m, t), = sizes.items()
            return lambda n: sizes[n] if n in sizes else t * n / m
        xs, ys = list(sizes), list(sizes.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
        a = max(0.0, my - b * mx)
        return lambda n: sizes[n] if n in sizes else a + b * n

    def _verify_prices(self, q_max: int) -> Callable[[int], float]:
        """Verify seconds of a q-row block for q <= ``q_max``, tabled once for a budget search: a timed
        size's own, an untimed one the nearest smaller timed size's (``cost_ratio``'s rule). Needs a
        timed 1-row step."""
        table, last = [0.0], self.step_time[1]
        for q in range(1, q_max + 1):
            last = self.step_time.get(q, last)
            table.append(last)
        return table.__getitem__

    def expected_tokens(self, k: int, key: Hashable = None) -> float:
        """Tokens one step yields when drafting a chain of k: 1 + the expected accepted drafts, from the
        measured acceptance per depth (``sequoia.PositionalAcceptance.chain``); k + 1 before any
        chain of the class was verified."""
        st = self.state(key)
        if st.positions.observed == 0:
            return float(k + 1)
        return 1.0 + sequoia.chain_values(st.positions.chain(k))[k]

    def cost_ratio(self, q: int) -> float | None:
        """Verify time of a q-row block over a 1-row block, or None before any block was timed.

        A size not timed yet is assumed as cheap as the nearest smaller timed one (cost never falls
        as q grows, so this is a lower bound): the controller is optimistic about it, drafts it when
        that would pay, and so times it. On a CPU the curve has steps (through specdec.runtime.kernels 2 rows
        cost what 1 does, 3-8 ~1.15x, 16 ~1.7x; without them 2 rows cost 1.6x), which neither
        extrapolation nor a guess would find.
        """
        t1 = self.step_time.get(1)
        if t1 is None:
            return None
        return self._verify_prices(q)(q) / t1

    def explored(self) -> int:
        """The most nodes worth pricing: one row past the largest block timed at the live batch. An
        untimed size is priced as the nearest smaller timed one (``cost_ratio``), cheap to be wrong
        about at batch 1 (8 rows cost ~1.2x one) but not at batch 8, where a 3-gram class priced
        7-token drafts at a 2-row block's 1.2x and paid 3.9x; growing one row at a time, each
        size is timed before a bigger one is tried. Example: timed {1, 2, 5} -> 5 nodes (6 rows)."""
        return max(self.step_time, default=1)

    def best_length(self, k_max: int, key: Hashable = None) -> int:
        """The k in [1, k_max] with the most tokens per second, or 0 if none beats not drafting."""
        st, t1 = self.state(key), self.step_time.get(1)
        if st.positions.observed == 0 or t1 is None:
            return k_max  # not measured yet: try it
        k_max = min(k_max, self.explored())
        # MagicDec's estimate (T_target = t(1), T_verify(k) = t(1 + k), T_draft = draft_cost(k)) with
        # the acceptance per depth in place of one alpha: a chain is a tree of one rank (Sequoia)
        return sequoia.best_budget(self._per_row(sequoia.chain_values(st.positions.chain(k_max)), st),
                                   self._verify_prices(k_max + 1), self._draft_prices(key))

    def _per_row(self, values: list[float], st: _ClassState) -> list[float]:
        """Expected accepted tokens per row of the live batch, from the values of a row that drafts:
        scaled by the class's measured share of rows that draft (1 at batch 1). The acceptance table
        counts only rows that drafted, so at B = 8 a 3-gram class whose match covered half the rows
        was priced as if every row would gain from a longer draft: prompt lookup's controller ran 5%
        behind a fixed one-token draft, and ``auto`` 11% (the Xeon, 2026-11-25)."""
        share = st.row_share if self.batch_size > 1 and st.row_share is not None else 1.0
        return values if share >= 1.0 else [v * share for v in values]

    def budget(self, key: Hashable = None) -> int:
        """Tokens to draft next, for a draft of class ``key``."""
        st = self.state(key)
        if not self.config.cost_aware:
            return st.length
        if 1 not in self.step_time:
            return 0  # time one plain step first: every cost below is relative to it
        if st.alpha is None and self.batch_size > 1:
            return 1  # a new class at a batch: a one-token probe first (B x 4 verify rows cost 4x a step)
        k = priced = self._chain_length(key)
        if st.gain is not None and st.gain > 1.001:
            # the measured gain is the last word both ways (a tree's gate too, ``tree_budget``): where
            # drafting steps have paid, at least a token, whatever the acceptance table predicts. The
            # table, decayed 2% per draft, still weighed an answer's first misses: StreamingLLM at 7k
            # tokens missed its first drafts, then probes of 1-3 tokens were taken whole and restarted
            # the gain for 80 steps while the table priced every length out (a fixed 2-token draft,
            # 0.91 accepted, was 5-6% faster than the controller over the answer). One token, not
            # more: the table's own length only grows past a draft taken whole (below)
            k = max(k, 1)
        if k > 0 and self._pays(st):
            st.interval = self.config.explore_every
            if self.batch_size == 1 and st.whole >= k and priced > 0:
                # the last draft, at least as long, was taken whole: one token past it, the depth
                # the table knows least about (one_step_beyond's optimism, for a chain; BASS's step
                # up). A miss at depth 2 in an answer's first step otherwise held StreamingLLM to
                # one- and two-token drafts for dozens of steps of whole acceptance. Not where the
                # table prices every length out: at 2k tokens (a StreamingLLM token ~0.9 of a step)
                # chains grown one past each whole one averaged 6 tokens and lost 11% to plain decoding
                k = min(st.whole + 1, self.config.maximum)
            return k
        if not self._probe(st):
            return 0
        # a probe: at a batch one token per row (B x 2 verify rows already cost up to 2x a step); at
        # batch 1 one token, two more after each probe taken whole: one-token probes re-measure depth
        # 1 only, and a miss at depth 2 in an answer's first step then priced every longer draft out
        # of the answer (StreamingLLM at 7k drafted 7 steps of 250; fixed k = 2 was 15% faster)
        return 1 if self.batch_size > 1 else st.probe_length

    def _chain_length(self, key: Hashable = None) -> int:
        """The cost model's chain length for class ``key`` up to ``maximum`` once its acceptance is
        measured (BASS's length before), no gate: ``budget``'s and ``shadow_size``'s rule."""
        st = self.state(key)
        return self.best_length(st.length if st.positions.observed == 0 else self.config.maximum, key)

    def _pays(self, st: _ClassState) -> bool:
        """The measured gain of this class's drafting steps (not the model's prediction) beats plain
        decoding, or is measured over fewer than ``min_samples`` steps. It is the last word: at batch
        B the prediction counts every row as drafting, while rows with nothing to draft pay for the
        others' verify rows."""
        return st.gain is None or st.gain_samples < self.config.min_samples or st.gain > 1.001

    def gate(self, key: Hashable = None) -> bool:
        """Draft at all this step? For drafters that size their own drafts (see the module doc)."""
        st = self.state(key)
        if not self.config.cost_aware:
            return True
        if self.step_time.get(1) is None:
            return False  # time a plain step first
        if self._pays(st):
            st.interval = self.config.explore_every
            return True
        return self._probe(st)

    def choose(self, keys: list[Hashable], size: Callable[[Hashable], int],
               free: Collection[Hashable] = ()) -> tuple[Hashable | None, int]:
        """Which of several sources' draft classes to draft in this step (``drafters.auto``), and how
        much: (class, ``size(class)``), or (None, 0) when none drafts. Classes are asked in this order
        what they would draft (``size``: the class's length rule or tree budget, whose gate may say 0):
        those with fewer than ``min_samples`` measured drafting steps (the least measured first),
        except the classes in ``free``, which are measured without drafting (their shadow drafts are
        scored, ``observe_shadow``; tried first, a new 2-token suffix match class drafted 6 steps of
        a 2k-token answer, none accepted, to be measured), those
        passed over ``revisit_every`` times (their gain may be stale), then the rest by measured gain
        (tokens per sequence per plain-step time), best first. The first that drafts is used. A class
        that says 0 passes the step on, until one whose measured gain does not beat plain decoding
        said 0: every class after it gains less (so the best source below plain decoding drafts
        nothing, apart from its probes). Before, the first class in that order was used whatever it
        said: a fresh 1-gram copy class that its length rule priced out held the step, and the
        sources that paid there, for the ~8 steps until its probe.
        Example: gains {"lookup": 1.4, "eagle": 1.1} -> "lookup"; after 64 such steps, "eagle" once;
        lookup's length rule says 0 -> "eagle"."""
        if not keys:
            return None, 0
        c, states = self.config, {k: self.state(k) for k in keys}
        fresh = sorted((k for k, st in states.items() if st.gain_samples < c.min_samples and k not in free),
                       key=lambda k: states[k].gain_samples)
        # a class whose shadow drafts are scored this run is measured every step: no turn needed
        due = [k for k, st in states.items() if st.idle >= c.revisit_every and k not in fresh and not st.shadowed]
        rest = sorted((k for k in keys if k not in fresh and k not in due),
                      key=lambda k: -(states[k].gain or 0.0))
        asked, pick, n = [], None, 0
        for k in fresh + due + rest:
            asked.append(k)
            n = size(k)
            if n > 0:
                pick = k
                break
            if k in rest and not self._pays(states[k]):
                break
        for k, st in states.items():
            st.idle = 0 if k in asked else st.idle + 1
        return pick, n  # n is 0 when no class drafts: the last one asked said so

    def tree_budget(self, cap: int, key: Hashable = None) -> int:
        """Nodes a tree drafter may propose next (0 = do not draft): the gate, then the Sequoia budget
        in [1, cap] from the measured acceptance per depth and rank (``cap`` until a tree was seen)."""
        if cap <= 0 or not self.gate(key):
            return 0
        st = self.state(key)
        if not self.config.cost_aware:
            return min(cap, self.config.tree_nodes) if self.config.tree_nodes else cap
        n = self._tree_size(cap, key)
        if st.positions.observed == 0 or 1 not in self.step_time:
            return n
        if st.probing:  # a probe is sized as a chain's: one node per row at a batch, probe_length at batch 1
            # (a full EAGLE tree as the probe of a gated-off class cost ~1.6 plain steps on a summary
            # where nothing was accepted; one node costs ~1.1)
            return 1 if self.batch_size > 1 else max(1, min(n, st.probe_length))
        return max(1, n)  # the gate (measured gain) says drafting pays: at least one node

    def _tree_size(self, cap: int, key: Hashable = None) -> int:
        """Sequoia's node budget in [0, cap] for a tree of class ``key`` from its measured acceptance
        per depth and rank and the verify times (no gate)."""
        st = self.state(key)
        if st.positions.observed == 0 or 1 not in self.step_time:
            # a new class: the drafter's own size at batch 1; at a batch one node per row first (B x
            # 17 verify rows over long rows cost several plain steps before anything is measured)
            return cap if self.batch_size == 1 else 1
        if st.values is None or st.positions.observed % self.config.retree_every == 0:
            st.values = sequoia.best_trees(sequoia.one_step_beyond(st.positions.table()), 32)[0]
        n_max = min(cap, self.explored())
        return sequoia.best_budget(self._per_row(st.values[: n_max + 1], st), self._verify_prices(n_max + 1),
                                   self._draft_prices(key))

    def shadow_size(self, cap: int, key: Hashable = None, tree: bool = False) -> int:
        """Nodes class ``key`` would draft now if it were chosen (its length rule, or Sequoia's budget
        for a tree), at least 1 and at most ``cap``, counting nothing (no probe is spent): the size of
        a shadow draft (``observe_shadow``). 0 before a plain step was timed."""
        if cap <= 0 or 1 not in self.step_time:
            return 0
        k = self._tree_size(cap, key) if tree else self._chain_length(key)
        return max(1, min(k, cap))

    def observe_shadow(self, parents: list[list[int]], accepted: list[list[int]], judged: list[int],
                       draft_time: float | None = None, key: Hashable = None) -> None:
        """A draft of class ``key`` that was made but not verified (greedy), per row of the batch: its
        nodes' parents, scored against the ``judged`` tokens the target committed in the row in the
        step (``tree.path_along``: exactly what the verifier would have kept, as far as those tokens
        go). Its acceptance enters the class's table (judged depths only) and its would-be gain the
        class's measured gain, priced at the verify time measured for its block size at the live
        batch and its draft time: per row of the batch, mean(1 + accepted) / ((t(1 + n) + d(n)) /
        t(1)), n the most nodes of a row. A path as long as the committed tokens was cut by them (the
        chosen draft stopped there), so the levels of the draft below its end count at the class's
        measured rates (their expected rest, ``sequoia.chain_values``): scored as stopped, a source
        that reached further than the one chosen looked no better than it, and the source chosen
        kept the steps. At a batch the
        rows without a draft count too (they pay for the others' verify rows), as in ``update``.

        Drafters whose drafts cost microseconds and change nothing (prompt lookup, suffix) are
        shadowed by ``drafters.auto`` at every step another source drafts (or none does), so each of
        their classes is measured on the whole text, not only where it was chosen. Measured only
        where chosen, a 512-row StreamingLLM draft at 2k tokens (its drafts cost ~0.85 of a target
        step a token, gain ~1.1) was chosen at the start of a summary's quotes, where a copy's class
        had matched 1-2 tokens, and drafted on through them: the copies' classes never saw the
        quotes, and auto ran 12% behind the suffix drafter alone.

        A shadow is sized by the class's rule, not drafted whole (tried, 8153d3a: every depth the
        text reached scored): a depth is judged only where the chosen draft got that far, i.e. where
        the text was easy, so deep acceptance read high and chains ran long: 1.3% slower on
        Spec-Bench in a same-process A/B; on the 2k book prompts 14% faster while StreamingLLM
        drafted there, level once it no longer did (``registry.make_auto``). At a batch, measured
        only where chosen, every class of a dozen (copies by match length, suffix buckets) drafted
        its first steps to be measured, each a verify of B x (1 + k) rows."""
        st, n = self.state(key), max((len(p) for p in parents), default=0)
        if n == 0:
            return
        st.shadowed = True
        for par, acc, judge in zip(parents, accepted, judged):
            if par:
                st.positions.observe(par, acc, judge)
        if draft_time is not None:
            st.draft_by_size[n] = _running_time(st.draft_by_size.get(n), draft_time, self.config.decay)
        if len(parents) > 1:
            share = sum(len(p) > 0 for p in parents) / len(parents)
            st.row_share = _running_mean(st.row_share, share, self.config.decay)
        t1 = self.step_time.get(1)
        if t1:
            tokens = 0.0
            for par, acc, judge in zip(parents, accepted, judged):
                tokens += 1 + len(acc)
                deeper = subtree_depth(par, acc[-1] if acc else -1) if par and len(acc) == judge else 0
                if deeper:  # the text ran out before the draft did: its expected rest at the class's rates
                    tokens += sequoia.chain_values(st.positions.chain(judge + deeper)[judge:])[deeper]
            per_row = tokens / len(accepted)
            self._add_gain(st, per_row / (self.cost_ratio(1 + n) + self.draft_cost(n, key) / t1))

    def _add_gain(self, st: _ClassState, gain: float) -> None:
        """One drafting step's gain into the class's mean: the plain mean of the first 1 / (1 -
        gate_decay) steps, the running mean after. A gate closed by one poor first step (an answer's
        first tokens) reopens after a good probe or two, not after ~14 probes spaced up to 64 steps
        apart (that is: never, in an answer)."""
        w = max(1.0 - self.config.gate_decay, 1.0 / (st.gain_samples + 1))
        st.gain = gain if st.gain is None else (1.0 - w) * st.gain + w * gain
        st.gain_samples += 1

    def observe_tree(self, parents: list[list[int]], accepted: list[list[int]], key: Hashable = None) -> None:
        """After verifying a draft (a chain is a tree of one rank): each row's real nodes' parents and
        its accepted path (node indices)."""
        pos = self.state(key).positions
        for par, acc in zip(parents, accepted):
            pos.observe(par, [a for a in acc if a >= 0])

    def _probe(self, st: _ClassState) -> bool:
        """While drafting is off: True once every ``interval`` steps, the interval doubling (to 8x), and
        never more often than ``probe_share`` allows at the live batch's measured cost of a probe, its
        source's catch-up after a pause included (EAGLE at B = 8: ~4 plain steps more, so its probes
        come every ~250 steps, not every 60).
        Never for a class whose shadow drafts are scored this run: they keep its gain current for free
        (probes of the suffix drafter's 1-token matches were 7 drafts of 256 tokens, none accepted)."""
        if st.shadowed:
            return False
        st.skipped += 1
        t1 = self.step_time.get(1)
        catch_up = st.catch_up / t1 if t1 else 0.0  # a probe after a pause pays the source's catch-up too
        spacing = math.ceil((self.probe_cost() + catch_up) / self.config.probe_share - 1e-9)
        if st.skipped < max(st.interval, spacing):
            return False
        st.skipped = 0
        st.interval = min(2 * st.interval, 8 * self.config.explore_every)  # back off (reset if it wins)
        st.probing = True
        return True

    def update(self, num_drafted: list[int], num_accepted: list[int], verify_time: float | None = None,
               draft_time: float | None = None, key: Hashable = None, grew: bool = False,
               resume: float = 0.0, catch_up: float = 0.0) -> None:
        """After a verified step: per-sequence drafted and accepted counts, the step's verify and
        draft seconds, the class of its draft, whether the step grew the target's store, the
        seconds the drafter spent catching up after a pause (``Drafter.resume_seconds``: in the
        step's gain, not in the draft size's price), and all its catch-up seconds, the prompt's
        too (``Drafter.catch_up_seconds``, not in ``draft_time``: the price of a probe, ``_probe``)."""
        c, st = self.config, self.state(key)
        probe, st.probing = st.probing, False
        q = 1 + max(num_drafted, default=0)
        # a step that grew the store (one in T: a copy of its rows that every block size pays alike)
        # is not a sample of its size's cost, unless the size has none yet (T = 1 grows every step)
        if verify_time is not None and not (grew and q in self.step_time):
            self.step_time[q] = _running_time(self.step_time.get(q), verify_time, c.decay)
            # fewer rows never cost more: a 1-row time measured once, on the process's first step (2x
            # a warm one), would stand for the whole session while every step drafts
            for smaller, t in self.step_time.items():
                if smaller < q and t > self.step_time[q]:
                    self.step_time[smaller] = self.step_time[q]
        if not any(num_drafted):
            return  # nothing was drafted (gated off, or no n-gram match): nothing learned
        if draft_time is not None:
            per_token = draft_time / max(num_drafted)
            self.draft_time = c.decay * self.draft_time + (1 - c.decay) * per_token
            n = max(num_drafted)
            st.draft_by_size[n] = _running_time(st.draft_by_size.get(n), draft_time, c.decay)
        st.skipped = 0
        if catch_up > 0:
            st.catch_up = _running_mean(st.catch_up or None, catch_up, c.decay)  # 0.0: none measured yet
        if len(num_drafted) > 1:
            st.row_share = _running_mean(st.row_share, sum(d > 0 for d in num_drafted) / len(num_drafted), c.decay)
        t1 = self.step_time.get(1)
        if verify_time is not None and draft_time is not None and t1:
            # per sequence: tokens this step yielded over its seconds in units of a plain step (which
            # yields 1 token per sequence); at B = 1: (1 + accepted) / ((verify + draft) / t1)
            per_row = sum(1 + a for a in num_accepted) / len(num_accepted)
            gain = per_row / ((verify_time + draft_time + resume) / t1)
            self._add_gain(st, gain)
            if probe and gain > 1.0:
                # a probe that paid: the text has changed since the gate closed (a summary's first
                # sentence is not the source, its body quotes it), so the gain is measured afresh and
                # probes come often again; kept, the mean of the poor start needed ~12 winning
                # probes, spaced up to 64 steps apart, to reopen the gate (never, in an answer)
                st.gain, st.gain_samples = gain, 1
                st.interval = c.explore_every
        # alpha: accepted tokens over tokens the target judged (a rejection ends the judging)
        hits = sum(num_accepted)
        trials = sum(a + (1 if a < d else 0) for d, a in zip(num_drafted, num_accepted) if d)
        rate = hits / max(1, trials)
        st.alpha = _running_mean(st.alpha, rate, c.decay)
        whole = all(a == d for d, a in zip(num_drafted, num_accepted))
        st.whole = max(num_drafted) if whole else 0
        if probe:
            st.probe_length = min(c.maximum, st.probe_length + c.step_up) if whole else max(1, max(num_accepted))
        if not c.adaptive:
            return
        if any(d > 0 and a == d for d, a in zip(num_drafted, num_accepted)):
            st.length = min(c.maximum, st.length + c.step_up)
            st.shrinks = 0
        else:
            cut = bass_shrink(st.length, st.shrinks) if c.shrink == "bass" else 1
            st.length = max(c.minimum, max(num_accepted), st.length - cut)
            st.shrinks += 1
