"""The draft-length controller: how much to draft at the next step, and from which source.

It composes the package's parts: the measured tables (``tables``: verify times per batch and block
size, per draft class the acceptance per depth and rank, draft seconds per size, the measured gain),
the pure cost functions (``cost``), the size policies (``policies``: fixed, BASS's schedule,
cost-aware chains, Sequoia's tree budget) and the source chooser (``chooser``). Its state is what it
measured; its decisions are the policies' answers on those tables.

One decoding step, as the decoder drives it:

    k = controller.budget(key)              # a chain drafter's length (0: decode plainly)
    n = controller.tree_budget(cap, key)    # a drafter that shapes its own tree: its node budget
    key, n = controller.choose(keys, size, free)   # several sources: which drafts, how much
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

from dataclasses import dataclass, replace
from typing import Callable, Collection, Hashable

from specdec.controller import chooser, cost, policies
from specdec.controller.tables import BatchGains, ClassState, VerifyTimes, running_mean, running_time
from specdec.tree import subtree_depth


@dataclass(frozen=True)
class DraftLengthConfig:
    """The controller's knobs, by the part that reads them: the length schedule (initial, minimum,
    maximum, step_up, adaptive, shrink), the cost gate (cost_aware, explore_every, probe_share, decay,
    gate_decay, min_samples), trees (tree_decay, retree_every, tree_nodes), the source chooser
    (revisit_every, min_samples). Why these defaults: docs/decisions/006-draft-length.md."""

    initial: int = 3  # first draft length (a 4-row verify)
    minimum: int = 1  # never ask for fewer (0 would turn drafting off for good)
    maximum: int = 10  # the longest chain the cost model may pick
    step_up: int = 2  # BASS: +2 after a step where some sequence accepted everything
    adaptive: bool = True  # False: always ask for `initial`
    cost_aware: bool = True  # draft only when the expected gain beats the measured verify cost
    explore_every: int = 8  # while gated off, probe every n steps (backs off to 8n)
    probe_share: float = 0.02  # ...and never more often than keeps probes' extra cost under this share
    decay: float = 0.8  # weight of the past in the running means (alpha, verify and draft times)
    gate_decay: float = 0.95  # the measured gain's running mean: a long memory (~20 steps)
    shrink: str = "one"  # after a step with no whole draft accepted: "one" token, or "bass" (bass_shrink)
    tree_decay: float = 0.98  # trees: weight of the past per observed tree in the depth x rank acceptance
    retree_every: int = 16  # trees: re-run Sequoia's program after this many observed trees
    revisit_every: int = 64  # several sources: a candidate passed over this many steps gets a turn
    min_samples: int = 3  # drafting steps measured before a class's gain is judged (and chosen first until then)
    tree_nodes: int = 0  # > 0 with cost_aware off: a fixed tree budget (a sweep's fixed setting)
    # at a batch where drafting does not pay (``priced_out``), one step in this many drafts as usual
    # (re-measuring it); the others draft nothing
    retime_every: int = 128
    batch_samples: int = 8  # drafting steps measured at a batch size before their pooled gain is judged

    @classmethod
    def bass(cls, **overrides) -> "DraftLengthConfig":
        """BASS's schedule as published: l0 = 7, +2 up to 32, ceil(l/10) shrinks, no cost gate."""
        return replace(cls(initial=7, maximum=32, step_up=2, shrink="bass", cost_aware=False), **overrides)


class DraftLengthController:
    def __init__(self, config: DraftLengthConfig = DraftLengthConfig()) -> None:
        if not 0 <= config.minimum <= config.initial <= config.maximum:
            raise ValueError(f"need 0 <= minimum <= initial <= maximum, got {config}")
        self.config = config
        self.classes: dict[Hashable, ClassState] = {}
        self.times = VerifyTimes()  # verify seconds per batch size and block size
        self.batch_size = 1
        self.draft_time: float = 0.0  # running seconds per drafted token over every class (an unseen class's price)
        self.batch_gains = BatchGains()  # every drafting step's gain per batch size > 1 (``priced_out``)
        self._priced_out_steps = 0  # steps ``priced_out`` said True since it last let one draft

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
        if key not in self.classes:
            c = self.config
            self.classes[key] = ClassState(c.initial, c.explore_every, c.tree_decay)
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

    def priced_out(self) -> bool:
        """Draft nothing this step, whatever the classes measured? At a batch every row pays for the
        widest row's block, so the batch's drafting is judged as one: True while (1) the drafting steps
        at this batch size (or the nearest one measured over ``batch_samples`` steps), whatever their
        class, gained no more than PAYS on average (``tables.BatchGains``), or (2) no draft can pay
        even if every node were accepted: a block of q rows a sequence yields at most q tokens a
        sequence, and every wider block timed here has q * t(1) / t(q) <= PAYS (a compute-bound CPU
        at a large batch). Once every ``retime_every`` such steps it says False (that step drafts as
        usual, re-measuring). False at batch 1 (each class's own gate decides there) and without the
        cost gate (why: docs/decisions/006-draft-length.md). Example: t = {1: 0.10, 2: 0.21} at batch 16
        -> 2 * 0.10 / 0.21 = 0.95: priced out."""
        t, c = self.step_time, self.config
        if self.batch_size == 1 or not c.cost_aware or 1 not in t:
            return False
        wider = [q for q in t if q > 1]
        pooled = self.batch_gains.near(self.batch_size, c.batch_samples)
        hopeless = bool(wider) and max(q * t[1] / t[q] for q in wider) <= policies.PAYS
        if not hopeless and (pooled is None or pooled > policies.PAYS):
            return False
        self._priced_out_steps += 1
        if self._priced_out_steps >= c.retime_every:
            self._priced_out_steps = 0
            return False
        return True

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
        return cost.draft_prices(self.state(key).draft_by_size, self.draft_time)

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
        st = self.state(key)
        if st.positions.observed == 0:
            return float(k + 1)
        return 1.0 + cost.chain_values(st.positions.chain(k))[k]

    def _share(self, st: ClassState) -> float:
        """The share of the live batch's rows that draft in the class (1 at batch 1 or unmeasured)."""
        return st.row_share if self.batch_size > 1 and st.row_share is not None else 1.0

    # ------------------------------------------------------------------------------- sizes

    def best_length(self, k_max: int, key: Hashable = None) -> int:
        """The cost-aware chain length in [0, k_max] (``policies.chain_size``); k_max unmeasured."""
        st = self.state(key)
        if st.positions.observed == 0 or self.step_time.get(1) is None:
            return k_max  # not measured yet: try it
        k_max = min(k_max, self.explored())
        return policies.chain_size(st.positions, k_max, self.step_time, self._draft_prices(key), self._share(st))

    def _chain_length(self, key: Hashable = None) -> int:
        """``best_length`` up to ``maximum`` once the class's acceptance is measured (BASS's length
        before), no gate: ``budget``'s and ``shadow_size``'s rule."""
        st = self.state(key)
        return self.best_length(st.length if st.positions.observed == 0 else self.config.maximum, key)

    def _tree_size(self, cap: int, key: Hashable = None) -> int:
        """Sequoia's node budget in [0, cap] (``policies.tree_values``, ``policies.best_size``), no
        gate; before a tree of the class was seen ``cap`` at batch 1, one node per row at a batch."""
        st = self.state(key)
        if st.positions.observed == 0 or 1 not in self.step_time:
            return cap if self.batch_size == 1 else 1
        if st.values is None or st.positions.observed % self.config.retree_every == 0:
            st.values = policies.tree_values(st.positions)
        n_max = min(cap, self.explored())
        return policies.best_size(st.values[: n_max + 1], self.step_time, self._draft_prices(key), self._share(st))

    def _pays(self, st: ClassState) -> bool:
        return policies.pays(st.gain, st.gain_samples, self.config.min_samples)

    def _probe(self, st: ClassState) -> bool:
        """While drafting is off: True once every ``interval`` steps (the interval doubling to 8x
        ``explore_every``) and no more often than ``cost.probe_spacing`` allows at the live batch,
        the source's catch-up included. Never for a class shadowed this run (measured for free)."""
        if st.shadowed:
            return False
        st.skipped += 1
        t1 = self.step_time.get(1)
        # what a probe pays before it drafts: at batch 1 the text of the pause (a prompt is fed once, at the
        # answer's first draft); at a batch also the prompts of rows that joined (decision 010)
        paid = st.resume if self.batch_size == 1 else st.catch_up
        spacing = cost.probe_spacing(self.probe_cost(), paid / t1 if t1 else 0.0, self.config.probe_share)
        if st.skipped < max(st.interval, spacing):
            return False
        st.skipped = 0
        st.interval = min(2 * st.interval, 8 * self.config.explore_every)  # back off (reset if it wins)
        st.probing = True
        return True

    def budget(self, key: Hashable = None) -> int:
        """Tokens to draft next in class ``key``: the schedule's length without the cost gate; with
        it 0 before a plain step was timed, a one-token probe for a new class at a batch, else the
        cost-aware length (``policies.gain_floor``, ``policies.past_whole``) while the measured gain
        pays, or a probe (``policies.probe_size``) when due."""
        st = self.state(key)
        if not self.config.cost_aware:
            return st.length
        if 1 not in self.step_time:
            return 0  # time one plain step first: every cost is relative to it
        if st.alpha is None and self.batch_size > 1:
            return 1
        priced = self._chain_length(key)
        # at batch 1 a gain from fewer than min_samples steps is not judged yet, as the gate's (at a batch a
        # drafting step verifies B rows a token: the table's price stands; docs/decisions/006-draft-length.md)
        judged = self.batch_size > 1 or st.gain_samples >= self.config.min_samples
        k = policies.gain_floor(priced, st.gain, judged)
        if k > 0 and self._pays(st):
            st.interval = self.config.explore_every
            grown = policies.past_whole(k, priced, st.whole, self.batch_size, self.config.maximum)
            return grown if grown == k or self._whole_pays(grown, k, key) else k
        if not self._probe(st):
            return 0
        return policies.probe_size(self.batch_size, st.probe_length)

    def _whole_pays(self, n: int, k: int, key: Hashable = None) -> bool:
        """Whether an n-token chain taken whole would cost no more a token than the k-token chain the
        table expects: (t(1 + n) + d(n)) / (1 + n) <= (t(1 + k) + d(k)) / E[tokens | k]. An untimed size
        is priced as the nearest smaller timed one (optimistic: growing times it)."""
        verify, draft = self._verify_prices(1 + n), self._draft_prices(key)  # n > k: the wider block
        return (verify(1 + n) + draft(n)) / (1 + n) <= (verify(1 + k) + draft(k)) / self.expected_tokens(k, key)

    def gate(self, key: Hashable = None) -> bool:
        """Draft at all this step (drafters that size their own drafts)? Without the cost gate yes;
        with it, not before a plain step was timed, then while the measured gain pays, else a probe."""
        st = self.state(key)
        if not self.config.cost_aware:
            return True
        if self.step_time.get(1) is None:
            return False
        if self._pays(st):
            st.interval = self.config.explore_every
            return True
        return self._probe(st)

    def tree_budget(self, cap: int, key: Hashable = None) -> int:
        """Nodes a tree drafter may propose next (0 = do not draft): the gate, then the Sequoia budget
        in [1, cap] (``cap`` until a tree was seen; ``tree_nodes`` without the cost gate)."""
        if cap <= 0 or not self.gate(key):
            return 0
        st = self.state(key)
        if not self.config.cost_aware:
            return min(cap, self.config.tree_nodes) if self.config.tree_nodes else cap
        n = self._tree_size(cap, key)
        if st.positions.observed == 0 or 1 not in self.step_time:
            return n
        if st.probing:
            return policies.probe_size(self.batch_size, st.probe_length, n)
        return max(1, n)  # the gate (measured gain) says drafting pays: at least one node

    def choose(self, keys: list[Hashable], size: Callable[[Hashable], int],
               free: Collection[Hashable] = ()) -> tuple[Hashable | None, int]:
        """Which of several sources' draft classes drafts this step, and how much (``chooser.choose``;
        ``size``: a class's length rule or tree budget; ``free``: classes measured by shadow drafts)."""
        c = self.config
        states = {k: self.state(k) for k in keys}
        return chooser.choose(keys, states, size, free, c.min_samples, c.revisit_every, self._pays)

    def shadow_size(self, cap: int, key: Hashable = None, tree: bool = False) -> int:
        """Nodes class ``key`` would draft now if chosen (its length rule, or Sequoia's budget for a
        tree), in [1, cap], spending no probe: the size of a shadow draft. 0 before a plain step."""
        if cap <= 0 or 1 not in self.step_time:
            return 0
        k = self._tree_size(cap, key) if tree else self._chain_length(key)
        return max(1, min(k, cap))

    # ------------------------------------------------------------------------------- learning

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
            per_row = _shadow_tokens(st, parents, accepted, judged) / len(accepted)
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
        self._learn_costs(st, num_drafted, draft_time, catch_up, resume)
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
        self._learn_schedule(st, num_drafted, num_accepted, probe)

    def _learn_costs(self, st: ClassState, num_drafted: list[int], draft_time: float | None,
                     catch_up: float, resume: float) -> None:
        """A drafting step's draft seconds (per token over every class, per size for the class), the
        source's catch-up (all of it, and after pauses), and at a batch the share of rows that drafted."""
        c = self.config
        if draft_time is not None:
            per_token = draft_time / max(num_drafted)
            self.draft_time = c.decay * self.draft_time + (1 - c.decay) * per_token
            n = max(num_drafted)
            st.draft_by_size[n] = running_time(st.draft_by_size.get(n), draft_time, c.decay)
        st.skipped = 0
        if catch_up > 0:
            st.catch_up = running_mean(st.catch_up or None, catch_up, c.decay)  # 0.0: none measured yet
        if resume > 0:
            st.resume = running_mean(st.resume or None, resume, c.decay)
        if len(num_drafted) > 1:
            st.row_share = running_mean(st.row_share, sum(d > 0 for d in num_drafted) / len(num_drafted), c.decay)

    def _learn_schedule(self, st: ClassState, num_drafted: list[int], num_accepted: list[int], probe: bool) -> None:
        """alpha (accepted over judged tokens: a rejection ends the judging), whether the draft was
        taken whole, the probe length, and BASS's length (``policies.next_length``)."""
        c = self.config
        hits = sum(num_accepted)
        trials = sum(a + (1 if a < d else 0) for d, a in zip(num_drafted, num_accepted) if d)
        st.alpha = running_mean(st.alpha, hits / max(1, trials), c.decay)
        whole = all(a == d for d, a in zip(num_drafted, num_accepted))
        st.whole = max(num_drafted) if whole else 0
        if probe:
            st.probe_length = policies.next_probe_length(st.probe_length, whole, num_accepted, c.maximum, c.step_up)
        if c.adaptive:
            st.length, st.shrinks = policies.next_length(st.length, st.shrinks, num_drafted, num_accepted,
                                                         c.minimum, c.maximum, c.step_up, c.shrink == "bass")


def _shadow_tokens(st: ClassState, parents: list[list[int]], accepted: list[list[int]], judged: list[int]) -> float:
    """Tokens a shadow draft would have yielded over its rows: 1 + accepted per row, plus, where the
    path ran as far as the committed text (it was cut there, not rejected), the expected rest of the
    draft below it at the class's measured chain rates (``cost.chain_values``).
    Example: rates [1, .5, .5], a 3-chain judged 1 deep with 1 accepted -> 2 + .5 + .25 = 2.75."""
    tokens = 0.0
    for par, acc, judge in zip(parents, accepted, judged):
        tokens += 1 + len(acc)
        deeper = subtree_depth(par, acc[-1] if acc else -1) if par and len(acc) == judge else 0
        if deeper:
            tokens += cost.chain_values(st.positions.chain(judge + deeper)[judge:])[deeper]
    return tokens
