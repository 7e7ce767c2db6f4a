"""The draft-length controller: how much to draft at each step, and from which source.

    tables.py        what is measured: running means, verify times per batch and block size,
                     acceptance per depth and sibling rank, each draft class's state
    cost.py          pure cost functions: MagicDec's model, the budget search, price tables,
                     the measured gain of a step, the BMC store's period
    sequoia.py       Sequoia's dynamic program: the best tree of n nodes for an acceptance table
    policies.py      sizes from the tables: fixed, BASS's schedule, cost-aware chains and trees
    chooser.py       which of several sources' classes drafts a step
    plan.py          a decision as a value: a question's answer and the schedule moves it implies
    learning.py      what a step teaches one draft class
    state.py         ControllerState: what the controller measured, the prices read off it, and the
                     observations (``observe`` a plan taken, ``update``, ``observe_tree``,
                     ``observe_shadow``), the only methods that change it
    draft_length.py  DraftLengthConfig and DraftLengthController (a ControllerState), which composes
                     the above: pure questions (``plan``, ``choose``, ``plan_shadow``, ``plan_batch``)
                     returning a Plan
    period.py        the BMC period model calibrated on this machine
"""

from specdec.controller.draft_length import DraftLengthConfig, DraftLengthController
from specdec.controller.plan import Plan

__all__ = ["DraftLengthConfig", "DraftLengthController", "Plan"]
