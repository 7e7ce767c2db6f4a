"""The draft-length controller: how much to draft at each step, and from which source.

    tables.py        what is measured: running means, verify times per batch and block size,
                     acceptance per depth and sibling rank, each draft class's state
    cost.py          pure cost functions: MagicDec's model, the budget search, price tables,
                     the measured gain of a step, the BMC store's period
    sequoia.py       Sequoia's dynamic program: the best tree of n nodes for an acceptance table
    policies.py      sizes from the tables: fixed, BASS's schedule, cost-aware chains and trees
    chooser.py       which of several sources' classes drafts a step
    plan.py          a decision as a value: a question's answer and the schedule moves it implies
    draft_length.py  DraftLengthConfig and DraftLengthController, which composes the above: pure
                     questions (``plan``, ``choose``, ``plan_shadow``, ``plan_batch``) returning a
                     Plan, and observations (``observe`` a plan taken, ``update``, ``observe_tree``,
                     ``observe_shadow``) that change its state
    period.py        the BMC period model calibrated on this machine
"""

from specdec.controller.draft_length import DraftLengthConfig, DraftLengthController
from specdec.controller.plan import Plan

__all__ = ["DraftLengthConfig", "DraftLengthController", "Plan"]
