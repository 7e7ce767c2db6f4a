"""The draft-size policies, each a function from the measured tables to a size.

- fixed: always the configured length (``DraftLengthConfig(adaptive=False, cost_aware=False)``);
- BASS's schedule (Qian et al., 2024): grow the length by ``step_up`` after a step where some
  sequence accepted its whole draft, otherwise shrink it (``next_length``), never below the most
  tokens accepted in that step;
- cost-aware: the size with the most expected tokens per second (``cost.best_budget``) given the
  acceptance per depth (a chain, ``chain_size``) or per depth and sibling rank (a tree, Sequoia's
  ``tree_size``), the verify times of the live batch and the drafter's own draft times; 0 when no
  size beats plain decoding. The measured gain of past drafting steps then has the last word
  (``pays``), and a class whose drafting is off is probed now and then (``probe_size``).

Why these rules: docs/decisions/006-draft-length.md (chains, the gate, probes, BASS) and
docs/decisions/007-tree-budget.md (trees).
"""

from __future__ import annotations

import math
from typing import Callable

from specdec.controller import cost, sequoia
from specdec.controller.tables import PositionalAcceptance

PAYS = 1.001  # a measured gain must beat plain decoding by this factor (a near tie drafts nothing)


def bass_shrink(length: int, consecutive: int) -> int:
    """BASS's cut after a step in which no sequence accepted its whole draft: ceil(l / 10), plus one
    for each shrink just before this one. Example: l = 25 -> 3, then (l = 22) 3 + 1 = 4, then 3 + 2."""
    return math.ceil(length / 10) + consecutive


def next_length(length: int, shrinks: int, drafted: list[int], accepted: list[int], minimum: int,
                maximum: int, step_up: int, bass: bool) -> tuple[int, int]:
    """BASS's (length, consecutive shrinks) after a verified step: + ``step_up`` (to ``maximum``) if a
    row accepted its whole non-empty draft, else - 1 (``bass``: - ``bass_shrink``), never below
    ``minimum`` nor the most tokens a row accepted.
    Example: length 5, drafted [5, 5], accepted [5, 2], step_up 2 -> (7, 0); accepted [3, 2] -> (4, 1)."""
    if any(d > 0 and a == d for d, a in zip(drafted, accepted)):
        return min(maximum, length + step_up), 0
    cut = bass_shrink(length, shrinks) if bass else 1
    return max(minimum, max(accepted), length - cut), shrinks + 1


def pays(gain: float | None, samples: int, min_samples: int) -> bool:
    """The measured gain of a class's drafting steps beats plain decoding, or is measured over fewer
    than ``min_samples`` steps (too few to judge). Example: (0.9, 2, 3) -> True; (0.9, 3, 3) -> False."""
    return gain is None or samples < min_samples or gain > PAYS


def best_size(values: list[float], step_time: dict[int, float], draft: Callable[[int], float],
              share: float) -> int:
    """The n in [0, len(values) - 1] with the most tokens per second (``cost.best_budget``), values[n]
    the expected accepted drafts of a drafting row, scaled by the ``share`` of rows that draft."""
    return cost.best_budget(cost.per_row(values, share), cost.verify_prices(step_time, len(values)), draft)


def chain_size(acc: PositionalAcceptance, k_max: int, step_time: dict[int, float],
               draft: Callable[[int], float], share: float) -> int:
    """The cost-aware chain length in [0, k_max]: a chain is a tree of one rank, valued from the
    measured acceptance per depth (``PositionalAcceptance.chain``), MagicDec's estimate with one rate
    per depth in place of one alpha. Example: rates [.9, .9], t(q) = 1 for q <= 3, free drafts -> 2."""
    return best_size(cost.chain_values(acc.chain(k_max)), step_time, draft, share)


def tree_values(acc: PositionalAcceptance, n_max: int = 32) -> list[float]:
    """Sequoia's expected accepted drafts of the best tree of n = 0..n_max nodes from the measured
    table with one step of optimism beyond it (``sequoia.one_step_beyond``)."""
    return sequoia.best_values(sequoia.one_step_beyond(acc.table()), n_max)


def gain_floor(priced: int, gain: float | None, judged: bool = True) -> int:
    """The cost-aware length after the measured gain's veto: where drafting steps have paid, or their
    gain is not ``judged`` yet (too few steps, as ``pays``: a tree's gate drafts a node then too), at
    least one token, whatever the acceptance table predicts. Example: (0, 1.2) -> 1; (0, 0.9) -> 0;
    (0, 0.3, judged=False) -> 1."""
    return max(priced, 1) if gain is not None and (not judged or gain > PAYS) else priced


def past_whole(k: int, priced: int, whole: int, batch_size: int, maximum: int) -> int:
    """At batch 1, when the last draft was at least ``k`` long and taken whole, one token past it (the
    depth the table knows least about), unless the table prices every length out (``priced`` 0).
    Example: k 3, whole 4 -> 5; whole 2 -> 3; batch 8 -> 3."""
    if batch_size == 1 and whole >= k and priced > 0:
        return min(whole + 1, maximum)
    return k


def probe_size(batch_size: int, probe_length: int, n: int | None = None) -> int:
    """A probe's size: one node per row at a batch; at batch 1 the class's probe length (for a tree,
    within [1, Sequoia's budget ``n``]). Example: (8, 3) -> 1; (1, 3) -> 3; (1, 3, n=2) -> 2."""
    if batch_size > 1:
        return 1
    return probe_length if n is None else max(1, min(n, probe_length))


def next_probe_length(probe_length: int, whole: bool, accepted: list[int], maximum: int, step_up: int) -> int:
    """After a probe at batch 1: + ``step_up`` (to ``maximum``) if taken whole, else the most accepted
    (at least 1). Example: 1 taken whole, step_up 2 -> 3; 3 with 1 accepted -> 1."""
    return min(maximum, probe_length + step_up) if whole else max(1, max(accepted))
