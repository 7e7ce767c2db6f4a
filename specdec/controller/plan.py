"""A draft decision as a value: what the controller's questions answer (``DraftLengthController.plan``,
``choose``, ``plan_shadow``, ``plan_batch``) and what asking them moves in its per-answer schedules.

Asking is itself something the controller learns from: a class gated off counts one more step toward
its next probe, a probe spends the class's turn, a class passed over in a choice waits one step
longer, Sequoia's values are refreshed when due, and a priced-out batch counts toward its next
re-timing step. A question computes those moves and returns them in its ``Plan`` without applying
them; ``DraftLengthController.observe(plan)`` applies them. So a question can be asked any number of
times (by a test, a report, a replay) and the controller changes only when a plan is taken:

    plan = controller.plan(key, cap=wanted)     # pure: Plan(key, size, schedules={key: ...})
    controller.observe(plan)                    # the step follows it: the schedules move
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from specdec.controller.tables import ClassState


@dataclass(frozen=True)
class Schedule:
    """A class's probe schedule (``ClassState``'s fields of the same names) as an ask leaves it."""

    skipped: int  # steps gated off since the class last drafted
    interval: int  # steps between probes
    probing: bool  # the step being drafted is a probe

    @classmethod
    def of(cls, st: ClassState) -> "Schedule":
        return cls(st.skipped, st.interval, st.probing)


@dataclass(frozen=True)
class Plan:
    """One decision: class ``key`` drafts ``size`` nodes (0: nothing; ``priced_out``: the whole batch
    drafts nothing this step), and the moves asking made, for ``observe`` to apply.
    Example: a gated-off class asked at its 3rd skipped step, a probe not due yet ->
    Plan(key, 0, schedules={key: Schedule(skipped=3, interval=8, probing=False)})."""

    key: Hashable = None  # the class that drafts (None: none)
    size: int = 0  # its nodes (a chain's length, a tree's node budget)
    priced_out: bool = False  # the batch's drafting does not pay this step (``plan_batch``)
    schedules: dict[Hashable, Schedule] = field(default_factory=dict)  # each class asked: its schedule after
    trees: dict[Hashable, list[float]] = field(default_factory=dict)  # Sequoia's values an ask refreshed
    idle: dict[Hashable, int] = field(default_factory=dict)  # after a choice: each candidate's steps passed over
    priced_out_steps: int | None = None  # the batch's priced-out step count after (None: unchanged)

