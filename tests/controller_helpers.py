"""Driving a DraftLengthController as the decoder does: ask a question, take the plan it answers
(``observe``), then draft what it says. A question alone changes nothing."""

from specdec.controller import DraftLengthController, Plan


def take(c: DraftLengthController, plan: Plan) -> Plan:
    """Follow ``plan`` (its schedule moves applied), as ``drafters.chooser.draft_step`` does."""
    c.observe(plan)
    return plan


def ask(c: DraftLengthController, key=None, cap: int | None = None, tree: bool = False) -> int:
    """The nodes a step drafts in class ``key``: a chain's length, or with ``tree`` a node budget of at
    most ``cap``; the plan taken."""
    return take(c, c.plan(key, cap, tree=tree)).size


def ask_batch(c: DraftLengthController) -> bool:
    """Whether a step at the live batch drafts nothing (``plan_batch``); the plan taken."""
    return take(c, c.plan_batch()).priced_out


def choice(c: DraftLengthController, keys: list, size, free=()) -> tuple:
    """(class, nodes) a step drafts among ``keys`` when class k would draft ``size(k)`` nodes
    (``choose``); the plan taken (the asked classes' idle counts reset, the others' counted on)."""
    plan = take(c, c.choose(keys, lambda k: Plan(k, size(k)), free))
    return plan.key, plan.size


def gate(c: DraftLengthController, key=None) -> bool:
    """Whether a drafter that sizes its own drafts drafts at all this step (a node budget of one asked);
    the plan taken."""
    return ask(c, key, 1, tree=True) > 0
