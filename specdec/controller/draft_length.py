"""The draft-length controller: how much to draft at the next step, and from which source.

It composes the package's parts: the measured tables (``tables``: verify times per batch and block
size, per draft class the acceptance per depth and rank, draft seconds per size, the measured gain),
the pure cost functions (``cost``), the size policies (``policies``), the source chooser
(``chooser``) and what a step teaches a class (``learning``). Its state is what it measured; its
decisions are the policies' answers on those tables. Questions change nothing: each returns a
``plan.Plan``, and the step that follows a plan tells the controller so (``observe``), which is when
asking moves the per-answer schedules (probe spacing, passed-over counts, the priced-out count).

One decoding step, as the decoder drives it (``drafters.chooser.draft_step``, ``session.learn_step``):

    plan = controller.plan_batch()                      # is the batch's drafting priced out?
    plan = controller.plan(key, cap=wanted)             # a chain drafter's length (0: decode plainly)
    plan = controller.plan(key, cap=wanted, tree=True)  # a drafter that shapes its own tree: its node budget
    plan = controller.choose(keys, plan_of, free)       # several sources: which drafts, how much
    plan = controller.plan_shadow(wanted, key)          # a free class's unverified draft
    controller.observe(plan)                            # ... each plan taken as it is made
    ...draft, verify...
    controller.update(drafted, accepted, verify_time, draft_time, key)  # times, gain, BASS's length
    controller.observe_tree(parents, accepted, key)                     # acceptance per depth, rank
    controller.observe_shadow(parents, paths, judged, seconds, key)     # a free source's unverified draft

The rules: with ``cost_aware`` off, the length is fixed (``adaptive`` off) or BASS's schedule. With
it on, a class first drafts BASS's initial length; once its acceptance is measured, the size with the
most expected tokens per second (``cost.best_budget``); the *measured* gain of its drafting steps
(tokens per sequence over seconds in plain steps, ``cost.step_gain``) vetoes that prediction both
ways (``policies.pays``, ``policies.gain_floor``); while drafting is off a probe comes every
``explore_every`` steps (doubling to 8x, spaced so probes cost under ``probe_share`` of the run).
Everything is kept per draft class (the key a drafter gives per step) and the gain per batch size;
verify and draft times are the machine's. The controller outlives one ``generate``: ``new_run``
restarts only the per-answer schedules.

Why: docs/decisions/006-draft-length.md (chains, gate, probes, BASS, batches),
007-tree-budget.md (trees), 009-shadow-drafts.md (shadows), 010-catch-up-pricing.md (catch-up).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Collection, Hashable

from specdec.controller import chooser, cost, learning, policies
from specdec.controller.config import DraftLengthConfig
from specdec.controller.plan import Plan, Schedule
from specdec.controller.tables import BatchGains, ClassState, VerifyTimes, running_mean, running_time

__all__ = ["DraftLengthConfig", "DraftLengthController"]


class DraftLengthController:
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

    # ------------------------------------------------------------------------------- sizes

    def best_length(self, k_max: int, key: Hashable = None) -> int:
        """The cost-aware chain length in [0, k_max] (``policies.chain_size``); k_max unmeasured."""
        st = self._known(key)
        if st.positions.observed == 0 or self.step_time.get(1) is None:
            return k_max  # not measured yet: try it
        k_max = min(k_max, self.explored())
        return policies.chain_size(st.positions, k_max, self.step_time, self._draft_prices(key), self._share(st))

    def _chain_length(self, key: Hashable = None) -> int:
        """``best_length`` up to ``maximum`` once the class's acceptance is measured (BASS's length
        before), no gate: ``_chain_budget``'s and ``plan_shadow``'s rule."""
        st = self._known(key)
        return self.best_length(st.length if st.positions.observed == 0 else self.config.maximum, key)

    def _tree_size(self, cap: int, key: Hashable = None) -> tuple[int, list[float] | None]:
        """Sequoia's node budget in [0, cap] (``policies.tree_values``, ``policies.best_size``), no gate,
        and the values it priced: the class's own, refreshed when none are kept or every
        ``retree_every`` observed trees. Before a tree of the class was seen: ``cap`` at batch 1, one
        node per row at a batch."""
        st = self._known(key)
        if st.positions.observed == 0 or 1 not in self.step_time:
            return (cap if self.batch_size == 1 else 1), st.values
        values = st.values
        if values is None or st.positions.observed % self.config.retree_every == 0:
            values = policies.tree_values(st.positions)
        n_max = min(cap, self.explored())
        return policies.best_size(values[: n_max + 1], self.step_time, self._draft_prices(key), self._share(st)), values

    def _pays(self, st: ClassState) -> bool:
        return policies.pays(st.gain, st.gain_samples, self.config.min_samples)

    def _probe(self, st: ClassState) -> tuple[bool, Schedule]:
        """While drafting is off: whether a probe is due this step, and the class's schedule after it (a
        probe: skipped reset, the interval doubled up to 8x ``explore_every``, probing; else one more
        step skipped). Due once every ``interval`` steps and no more often than ``cost.probe_spacing``
        allows at the live batch, the source's catch-up included. Never for a class shadowed this run
        (measured for free: nothing counted)."""
        now = Schedule.of(st)
        if st.shadowed:
            return False, now
        t1 = self.step_time.get(1)
        # what a probe pays before it drafts: at batch 1 the text of the pause (a prompt is fed once, at the
        # answer's first draft); at a batch also the prompts of rows that joined (decision 010)
        paid = st.resume if self.batch_size == 1 else st.catch_up
        spacing = cost.probe_spacing(self.probe_cost(), paid / t1 if t1 else 0.0, self.config.probe_share)
        if st.skipped + 1 < max(st.interval, spacing):
            return False, replace(now, skipped=st.skipped + 1)
        return True, Schedule(0, min(2 * st.interval, 8 * self.config.explore_every), True)  # back off (reset if it wins)

    def _gate(self, st: ClassState) -> tuple[bool, Schedule]:
        """Draft at all this step (a drafter that sizes its own drafts), and the class's schedule after?
        Without the cost gate yes; with it, not before a plain step was timed, then while the measured
        gain pays (the probe interval back to ``explore_every``), else a probe when due."""
        now = Schedule.of(st)
        if not self.config.cost_aware:
            return True, now
        if self.step_time.get(1) is None:
            return False, now
        if self._pays(st):
            return True, replace(now, interval=self.config.explore_every)
        return self._probe(st)

    def _chain_budget(self, key: Hashable = None) -> tuple[int, Schedule]:
        """Tokens to draft next in class ``key`` and its schedule after: the schedule's length without
        the cost gate; with it 0 before a plain step was timed, a one-token probe for a new class at a
        batch, else the cost-aware length (``policies.gain_floor``, ``policies.past_whole``) while the
        measured gain pays, or a probe (``policies.probe_size``) when due."""
        st = self._known(key)
        now = Schedule.of(st)
        if not self.config.cost_aware:
            return st.length, now
        if 1 not in self.step_time:
            return 0, now  # time one plain step first: every cost is relative to it
        if st.alpha is None and self.batch_size > 1:
            return 1, now
        priced = self._chain_length(key)
        # at batch 1 a gain from fewer than min_samples steps is not judged yet, as the gate's (at a batch a
        # drafting step verifies B rows a token: the table's price stands; docs/decisions/006-draft-length.md)
        judged = self.batch_size > 1 or st.gain_samples >= self.config.min_samples
        k = policies.gain_floor(priced, st.gain, judged)
        if k > 0 and self._pays(st):
            grown = policies.past_whole(k, priced, st.whole, self.batch_size, self.config.maximum)
            k = grown if grown == k or self._whole_pays(grown, k, key) else k
            return k, replace(now, interval=self.config.explore_every)
        probe, after = self._probe(st)
        return (policies.probe_size(self.batch_size, st.probe_length) if probe else 0), after

    def _whole_pays(self, n: int, k: int, key: Hashable = None) -> bool:
        """Whether an n-token chain taken whole would cost no more a token than the k-token chain the
        table expects: (t(1 + n) + d(n)) / (1 + n) <= (t(1 + k) + d(k)) / E[tokens | k]. An untimed size
        is priced as the nearest smaller timed one (optimistic: growing times it)."""
        verify, draft = self._verify_prices(1 + n), self._draft_prices(key)  # n > k: the wider block
        return (verify(1 + n) + draft(n)) / (1 + n) <= (verify(1 + k) + draft(k)) / self.expected_tokens(k, key)

    def _tree_budget(self, cap: int, key: Hashable = None) -> Plan:
        """Nodes a tree drafter may propose next (0 = do not draft): the gate, then the Sequoia budget
        in [1, cap] (``cap`` until a tree was seen; ``tree_nodes`` without the cost gate)."""
        if cap <= 0:
            return Plan(key, 0)
        st = self._known(key)
        go, after = self._gate(st)
        if not go:
            return self._plan(key, 0, after)
        if not self.config.cost_aware:
            return self._plan(key, min(cap, self.config.tree_nodes) if self.config.tree_nodes else cap, after)
        n, values = self._tree_size(cap, key)
        if st.positions.observed == 0 or 1 not in self.step_time:
            return self._plan(key, n, after, values)
        if after.probing:
            return self._plan(key, policies.probe_size(self.batch_size, st.probe_length, n), after, values)
        return self._plan(key, max(1, n), after, values)  # the gate (measured gain) says drafting pays: a node

    def _plan(self, key: Hashable, size: int, after: Schedule, values: list[float] | None = None) -> Plan:
        """A plan of class ``key``'s draft of ``size`` nodes that moves its schedule to ``after`` and its
        Sequoia values to ``values`` (None: kept), each only where it changes."""
        st = self._known(key)
        return Plan(key, size, schedules={key: after} if after != Schedule.of(st) else {},
                    trees={key: values} if values is not None and values is not st.values else {})

    # ------------------------------------------------------------------------------- questions

    def plan(self, key: Hashable = None, cap: int | None = None, tree: bool = False) -> Plan:
        """What class ``key`` drafts this step, changing nothing (``observe`` takes the plan): a chain's
        length (``_chain_budget``; at most ``cap``, the tokens still wanted), or with ``tree`` the node
        budget of a drafter that shapes its own tree (``_tree_budget``; ``cap`` needed)."""
        if tree:
            return self._tree_budget(cap, key)
        k, after = self._chain_budget(key)
        return self._plan(key, k if cap is None else min(k, cap), after)

    def choose(self, keys: list[Hashable], plan_of: Callable[[Hashable], Plan],
               free: Collection[Hashable] = ()) -> Plan:
        """Which of several sources' draft classes drafts this step, and how much (``chooser.choose``),
        changing nothing: ``plan_of`` gives a class's own plan (``plan``), ``free`` the classes measured by
        shadow drafts. The plan carries every asked class's moves and each candidate's passed-over count."""
        c = self.config
        states = {k: self._known(k) for k in keys}
        plans: dict[Hashable, Plan] = {}

        def size(k: Hashable) -> int:
            plans[k] = plan_of(k)
            return plans[k].size

        pick, n, asked = chooser.choose(keys, states, size, free, c.min_samples, c.revisit_every, self._pays)
        return Plan(pick, n, schedules={k: s for p in plans.values() for k, s in p.schedules.items()},
                    trees={k: v for p in plans.values() for k, v in p.trees.items()},
                    idle={k: 0 if k in asked else st.idle + 1 for k, st in states.items()})

    def plan_shadow(self, cap: int, key: Hashable = None, tree: bool = False) -> Plan:
        """Nodes class ``key`` would draft now if chosen (its length rule, or Sequoia's budget for a tree),
        in [1, cap], spending no probe: the size of a shadow draft; 0 before a plain step. Its only move:
        Sequoia's values when due."""
        if cap <= 0 or 1 not in self.step_time:
            return Plan(key, 0)
        st = self._known(key)
        k, values = self._tree_size(cap, key) if tree else (self._chain_length(key), None)
        return self._plan(key, max(1, min(k, cap)), Schedule.of(st), values)

    def priced_out(self) -> bool:
        """Draft nothing this step, whatever the classes measured? (``_priced_out_steps_after``)"""
        return bool(self._priced_out_steps_after())

    def plan_batch(self) -> Plan:
        """The batch's verdict before any class is asked: ``priced_out``, and the count it moves."""
        return Plan(priced_out=self.priced_out(), priced_out_steps=self._priced_out_steps_after())

    def _priced_out_steps_after(self) -> int | None:
        """The priced-out step count after this step: None (unchanged) while drafting is not priced out,
        else one more, or 0 on every ``retime_every``-th such step (that step drafts as usual,
        re-measuring). At a batch every row pays for the widest row's block, so the batch's drafting is
        judged as one: priced out while (1) the drafting steps at this batch size (or the nearest one
        measured over ``batch_samples`` steps), whatever their class, gained no more than PAYS on average
        (``tables.BatchGains``), or (2) no draft can pay even if every node were accepted: a block of q
        rows a sequence yields at most q tokens a sequence, and every wider block timed here has
        q * t(1) / t(q) <= PAYS (a compute-bound CPU at a large batch). Never at batch 1 (each class's
        own gate decides there) nor without the cost gate (why: docs/decisions/006-draft-length.md).
        Example: t = {1: 0.10, 2: 0.21} at batch 16 -> 2 * 0.10 / 0.21 = 0.95: priced out."""
        t, c = self.step_time, self.config
        if self.batch_size == 1 or not c.cost_aware or 1 not in t:
            return None
        wider = [q for q in t if q > 1]
        pooled = self.batch_gains.near(self.batch_size, c.batch_samples)
        hopeless = bool(wider) and max(q * t[1] / t[q] for q in wider) <= policies.PAYS
        if not hopeless and (pooled is None or pooled > policies.PAYS):
            return None
        steps = self._priced_out_steps + 1
        return 0 if steps >= c.retime_every else steps

    # ------------------------------------------------------------------------------- learning

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
