"""The draft-length controller's state, the prices read off it, and the observations that change it.

``ControllerState`` is what the controller (``draft_length.DraftLengthController``, its subclass that
asks the questions) has measured: each draft class's ``tables.ClassState`` (acceptance per depth and
rank, draft seconds per size, the measured gain, the per-answer schedules), the verify seconds per
batch and block size (``tables.VerifyTimes``), the draft seconds per token over every class (an unseen
class's price), each batch size's gain (``tables.BatchGains``) and the batch's priced-out count.

    prices        pure reads of those tables (``cost``): a probe's, a draft's and a block's price,
                  the tokens a chain of k is expected to yield
    observations  the only methods that change the state: ``new_run`` and ``set_batch`` between runs,
                  ``observe`` (a plan taken: the moves its question computed), ``update`` (a verified
                  step's times, gain and BASS's length), ``observe_tree`` (acceptance per depth and
                  rank), ``observe_shadow`` (an unverified draft); what a step teaches one class is
                  ``learning``'s

Why: docs/decisions/006-draft-length.md, 009-shadow-drafts.md (shadows), 010-catch-up-pricing.md.
"""

from __future__ import annotations

from typing import Callable, Hashable

from specdec.controller import cost, learning
from specdec.controller.config import DraftLengthConfig
from specdec.controller.plan import Plan
from specdec.controller.tables import BatchGains, ClassState, VerifyTimes, running_mean, running_time


class ControllerState:
    """What the draft-length controller measured (the tables the module docstring lists), the prices read
    off it, and the observations, the only methods that change it."""

    def __init__(self, config: DraftLengthConfig = DraftLengthConfig()) -> None:
        if not 0 <= config.minimum <= config.initial <= config.maximum:
            raise ValueError(f"need 0 <= minimum <= initial <= maximum, got {config}")
        self.config = config
        self.classes: dict[Hashable, ClassState] = {}
        self.times = VerifyTimes()  # verify seconds per batch size and block size
        self.batch_size = 1
        self.draft_time: float = 0.0  # running seconds per drafted token over every class (an unseen class's price)
        self.batch_gains = BatchGains()  # every drafting step's gain per batch size > 1 (``plan_batch``)
        self._priced_out_steps = 0  # priced-out steps taken since the last re-timing one (``plan_batch``)

    @property
    def step_time(self) -> dict[int, float]:
        """The live batch's verify seconds per block size q."""
        return self.times.live

    @step_time.setter
    def step_time(self, table: dict[int, float]) -> None:
        self.times.live = table

    # ------------------------------------------------------------------------------ runs, batches

    def new_run(self, batch_size: int) -> None:
        """A new ``generate`` call: keep what was measured, restart the per-answer schedules (BASS's
        length, probe spacing, shadows). At batch 1 a class's gain then weighs as ``min_samples`` - 1
        steps, so each class drafts at least once in the answer. Without the cost gate nothing
        measured steers the drafts, so a seeded sampling run repeats."""
        self.set_batch(batch_size)
        c = self.config
        for st in self.classes.values():
            st.length, st.shrinks = c.initial, 0
            st.skipped, st.interval, st.probe_length, st.shadowed = 0, c.explore_every, 1, False
            if batch_size == 1:  # not at a batch: docs/decisions/006-draft-length.md
                st.gain_samples = min(st.gain_samples, c.min_samples - 1)

    def set_batch(self, batch_size: int) -> None:
        """The live batch size changed (sequences finished): verify times and each class's measured
        gain are that batch size's own, an unmeasured size starting from the nearest measured one."""
        if batch_size < 1:
            return  # every row finished: the next run sets its own
        if batch_size != self.batch_size:
            for st in self.classes.values():
                st.switch_batch(self.batch_size, batch_size)
        self.times.select(batch_size)
        self.batch_size = batch_size

    def state(self, key: Hashable = None) -> ClassState:
        """Class ``key``'s state, kept from its first use (what observations write to)."""
        if key not in self.classes:
            self.classes[key] = self._fresh()
        return self.classes[key]

    def _known(self, key: Hashable = None) -> ClassState:
        """Class ``key``'s state for a question: the kept one, or a fresh one not kept (a class never used)."""
        st = self.classes.get(key)
        return st if st is not None else self._fresh()

    def _fresh(self) -> ClassState:
        c = self.config
        return ClassState(c.initial, c.explore_every, c.tree_decay)

    @property
    def alpha(self) -> float | None:
        """The default class's acceptance rate (a drafter without classes has only that one)."""
        return self._known().alpha

    @alpha.setter
    def alpha(self, value: float | None) -> None:
        self.state().alpha = value

    @property
    def length(self) -> int:
        return self._known().length

    # ---------------------------------------------------------------------------------- prices

    def probe_cost(self) -> float:
        """A one-token probe's extra verify time in plain steps (``cost.probe_cost``) at the live
        batch or the nearest batch size where it was timed; 0 before any were timed."""
        table = self.times.probe_table(self.batch_size)
        return 0.0 if table is None else cost.probe_cost(table)

    def draft_cost(self, n: int, key: Hashable = None) -> float:
        """Seconds to draft n nodes in class ``key`` (``cost.draft_prices``)."""
        return self._draft_prices(key)(n)

    def _draft_prices(self, key: Hashable = None) -> Callable[[int], float]:
        return cost.draft_prices(self._known(key).draft_by_size, self.draft_time)

    def _verify_prices(self, q_max: int) -> Callable[[int], float]:
        return cost.verify_prices(self.step_time, q_max)

    def cost_ratio(self, q: int) -> float | None:
        """t(q) / t(1) (``cost.verify_prices``: an untimed size as the nearest smaller timed one), or
        None before a plain step was timed."""
        t1 = self.step_time.get(1)
        if t1 is None:
            return None
        return self._verify_prices(q)(q) / t1

    def explored(self) -> int:
        """The most nodes worth pricing: one row past the largest block timed at the live batch (each
        size is timed before a bigger one is tried). Example: timed {1, 2, 5} -> 5 nodes (6 rows)."""
        return max(self.step_time, default=1)

    def expected_tokens(self, k: int, key: Hashable = None) -> float:
        """Tokens one step yields when drafting a chain of k: 1 + the expected accepted drafts from
        the measured acceptance per depth; k + 1 before any chain of the class was verified."""
        st = self._known(key)
        if st.positions.observed == 0:
            return float(k + 1)
        return 1.0 + cost.chain_values(st.positions.chain(k))[k]

    def _share(self, st: ClassState) -> float:
        """The share of the live batch's rows that draft in the class (1 at batch 1 or unmeasured)."""
        return st.row_share if self.batch_size > 1 and st.row_share is not None else 1.0

    # ---------------------------------------------------------------------------- observations

    def observe(self, plan: Plan) -> None:
        """The step follows ``plan``: apply the moves its questions computed (probe schedules, Sequoia's
        values, passed-over counts, the batch's priced-out count)."""
        for key, s in plan.schedules.items():
            st = self.state(key)
            st.skipped, st.interval, st.probing = s.skipped, s.interval, s.probing
        for key, values in plan.trees.items():
            self.state(key).values = values
        for key, idle in plan.idle.items():
            self.state(key).idle = idle
        if plan.priced_out_steps is not None:
            self._priced_out_steps = plan.priced_out_steps

    def observe_shadow(self, parents: list[list[int]], accepted: list[list[int]], judged: list[int],
                       draft_time: float | None = None, key: Hashable = None) -> None:
        """A draft of class ``key`` made but not verified (greedy), per row: its nodes' parents,
        scored against the ``judged`` tokens the target committed in the row (``tree.path_along``).
        Its acceptance enters the class's table (judged depths only) and its would-be gain the
        class's gain (``cost.shadow_gain``): per row mean(1 + accepted [+ the expected rest of a path
        cut by the text]) / (t(1 + n) / t(1) + d(n) / t(1)), n the most nodes of a row; rows without
        a draft count too. Why shadows, and sized by the class's rule: docs/decisions/009-shadow-drafts.md."""
        st, n = self.state(key), max((len(p) for p in parents), default=0)
        if n == 0:
            return
        st.shadowed = True
        for par, acc, judge in zip(parents, accepted, judged):
            if par:
                st.positions.observe(par, acc, judge)
        if draft_time is not None:
            st.draft_by_size[n] = running_time(st.draft_by_size.get(n), draft_time, self.config.decay)
        if len(parents) > 1:
            share = sum(len(p) > 0 for p in parents) / len(parents)
            st.row_share = running_mean(st.row_share, share, self.config.decay)
        t1 = self.step_time.get(1)
        if t1:
            per_row = learning.shadow_tokens(st, parents, accepted, judged) / len(accepted)
            st.add_gain(cost.shadow_gain(per_row, self.cost_ratio(1 + n), self.draft_cost(n, key), t1),
                        self.config.gate_decay)

    def observe_tree(self, parents: list[list[int]], accepted: list[list[int]], key: Hashable = None) -> None:
        """After verifying a draft (a chain is a tree of one rank): each row's real nodes' parents and
        its accepted path (node indices)."""
        pos = self.state(key).positions
        for par, acc in zip(parents, accepted):
            pos.observe(par, [a for a in acc if a >= 0])

    def update(self, num_drafted: list[int], num_accepted: list[int], verify_time: float | None = None,
               draft_time: float | None = None, key: Hashable = None, grew: bool = False,
               resume: float = 0.0, catch_up: float = 0.0) -> None:
        """After a verified step: per-sequence drafted and accepted counts, the step's verify and draft
        seconds, the class of its draft, whether the step grew the target's store (then not a sample
        of its block size's cost), the drafter's catch-up seconds after a pause (``resume``: in the
        step's gain, not in the draft size's price; a probe's price at batch 1) and all its catch-up
        seconds (``catch_up``: a probe's price at a batch). Why: docs/decisions/010-catch-up-pricing.md."""
        c, st = self.config, self.state(key)
        probe, st.probing = st.probing, False
        if verify_time is not None:
            self.times.record(1 + max(num_drafted, default=0), verify_time, grew, c.decay)
        if not any(num_drafted):
            return  # nothing was drafted (gated off, or no n-gram match): nothing learned
        if draft_time is not None:  # every class's price per token (an unseen class's), then the class's own
            self.draft_time = c.decay * self.draft_time + (1 - c.decay) * (draft_time / max(num_drafted))
        learning.learn_costs(st, c, num_drafted, draft_time, catch_up, resume)
        t1 = self.step_time.get(1)
        if verify_time is not None and draft_time is not None and t1:
            gain = cost.step_gain(sum(1 + a for a in num_accepted), len(num_accepted),
                                  verify_time + draft_time + resume, t1)
            st.add_gain(gain, c.gate_decay)
            if self.batch_size > 1:
                self.batch_gains.add(self.batch_size, gain, c.gate_decay)
            if probe and gain > 1.0:  # a probe that paid: the text changed, measure the gain afresh
                st.gain, st.gain_samples = gain, 1
                st.interval = c.explore_every
        learning.learn_schedule(st, c, num_drafted, num_accepted, probe)
