"""The draft-length controller: how much to draft at the next step, and from which source.

It composes the package's parts: the measured tables (``tables``: verify times per batch and block
size, per draft class the acceptance per depth and rank, draft seconds per size, the measured gain),
the pure cost functions (``cost``), the size policies (``policies``), the source chooser
(``chooser``) and what a step teaches a class (``learning``). Its state is what it measured, kept
with the prices read off it and the observations that change it in ``state.ControllerState``, which
this module's controller extends with the questions; its decisions are the policies' answers on
those tables. Questions change nothing: each returns a ``plan.Plan``, and the step that follows a plan
tells the controller so (``observe``), which is when asking moves the per-answer schedules (probe
spacing, passed-over counts, the priced-out count).

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

from specdec.controller import chooser, cost, policies
from specdec.controller.config import DraftLengthConfig
from specdec.controller.plan import Plan, Schedule
from specdec.controller.state import ControllerState
from specdec.controller.tables import ClassState

__all__ = ["DraftLengthConfig", "DraftLengthController"]


# a subclass, not a holder of the state: the decoder, the sessions, the benches and the tests read one
# object's tables (``controller.classes``, ``step_time``, ``state(key)``), as they did before the split
class DraftLengthController(ControllerState):
    """The questions: what to draft this step, and from which source, each answer a ``Plan`` that
    changes nothing until ``observe`` takes it (the state and the observations: ``state``)."""

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
