"""Tree sizing and shape from measured acceptance: Sequoia's dynamic program, as pure functions.

After Sequoia (Chen et al., 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative
Decoding"). Its *positional acceptance* assumption: the chance that the target accepts the child of
sibling rank r (0 = the drafter's best guess) of an accepted node depends only on r, here also on
the child's depth d (1 = a child of the pending token): ``acc[d - 1][r]``. A node is then accepted
with the product of ``acc`` along its path, and a tree's expected accepted tokens is the sum of that
over its nodes. Sequoia finds, for each node budget n, the tree with the most expected accepted
tokens (a dynamic program over how a subtree's nodes split among its children), then the budget
whose tokens per second are best given the hardware's verify time for 1 + n rows.

    values, shape = best_trees(acc, n_max=16)        # values[n]: expected accepted tokens, n nodes
    n = cost.best_budget(values, verify_time=t, draft_time=lambda n: 0.0)   # t(q): seconds for q rows

Worked example: acc = [[0.8, 0.1]] (depth 1 only: two candidates for the next token, no deeper
level). One node: the rank-0 child, 0.8 expected. Two nodes: both ranks, 0.8 + 0.1 = 0.9. A third
node has nowhere to go (depth 1 has two ranks), so values = [0, 0.8, 0.9, 0.9].
With acc = [[0.8], [0.5]] (a chain of two): values = [0, 0.8, 0.8 + 0.8 * 0.5 = 1.2].

The controller estimates ``acc`` per draft class from the trees it sees verified
(``tables.PositionalAcceptance``) and asks ``cost.best_budget`` how many nodes a tree drafter may
propose; the shapes are what Sequoia would draft (tree drafters here shape their own trees by draft
scores and take only the budget).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def best_trees(acc: Sequence[Sequence[float]], n_max: int) -> tuple[list[float], list[list[int]]]:
    """For n = 0..n_max drafted nodes, the most expected accepted tokens of a tree of n nodes, and
    one such tree (parents, -1 = child of the pending token; parents precede children; siblings in
    rank order). acc[d][r] in [0, 1]: acceptance of the rank-r child at depth d + 1.

    The recursion (Sequoia's c(n), with depth and a rank-ordered split): a subtree of m nodes whose
    root sits at depth d is the root plus a split of m - 1 nodes among its children of rank
    0, 1, ... (a rank is used only if every lower rank is: ranks are drafted best first), each child
    weighted by its own acceptance:
        sub(d, m)     = 1 + split(d + 1, 0, m - 1)                 (m >= 1)
        split(d, r, 0) = 0
        split(d, r, m) = max over j in 1..m of acc[d][r] * sub(d, j) + split(d, r + 1, m - j)
    values[n] = split(depth 1, rank 0, n). O(depth x ranks x n_max^2), one vector step per (depth, rank).
    """
    split, choice = _program(acc, n_max, choices=True)
    choice = [c.tolist() for c in choice]
    return _values(split, n_max), [_rebuild(choice, acc, n) for n in range(n_max + 1)]


def best_values(acc: Sequence[Sequence[float]], n_max: int) -> list[float]:
    """``best_trees``' values alone (what the controller prices; the trees are not rebuilt)."""
    return _values(_program(acc, n_max)[0], n_max)


def _values(split: list[np.ndarray], n_max: int) -> list[float]:
    return split[0][0].tolist() if split else [0.0] * (n_max + 1)


def _program(acc: Sequence[Sequence[float]], n_max: int,
             choices: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The recursion's tables per depth d: split[d] [ranks + 1, n_max + 1] and, with ``choices``, the j
    that made each entry (choice, 0: no node), deepest level first (sub at d needs split at d + 1,
    split at d needs sub at d). A near tie (1e-12) goes to the smallest j: fewer nodes under the
    better-ranked child."""
    if n_max < 0:
        raise ValueError(f"n_max must be >= 0, got {n_max}")
    for d, row in enumerate(acc):
        for r, a in enumerate(row):
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance must be in [0, 1], got acc[{d}][{r}] = {a}")
    D, N = len(acc), n_max + 1
    # rest[m, j - 1] = m - j, the nodes left for the later ranks when a child's subtree takes j of m (j in
    # 1..m; ``closed`` is -inf where j > m): one (depth, rank) is one step over every m and j at once
    rest = np.arange(N)[:, None] - np.arange(1, N)[None, :]
    closed = np.where(rest >= 0, 0.0, -np.inf)
    rest = np.maximum(rest, 0)
    split: list[np.ndarray] = [np.zeros((0, N))] * D
    choice: list[np.ndarray] = [np.zeros((0, N), dtype=np.int64)] * D
    for d in range(D - 1, -1, -1):
        sub = 1.0 + (split[d + 1][0][:-1] if d + 1 < D else np.zeros(n_max))  # sub[j - 1]: a j-node subtree
        split[d] = np.zeros((len(acc[d]) + 1, N))
        choice[d] = np.zeros((len(acc[d]) + 1, N), dtype=np.int64)
        if n_max == 0:
            continue
        for r in range(len(acc[d]) - 1, -1, -1):
            v = acc[d][r] * sub[None, :] + split[d][r + 1][rest] + closed  # [N, N - 1]: v[m, j - 1]
            best = v.max(axis=1)
            keep = best > 1e-12
            split[d][r] = np.where(keep, best, 0.0)
            if choices:
                choice[d][r] = np.where(keep, np.argmax(v >= (best - 1e-12)[:, None], axis=1) + 1, 0)
    return split, choice


def _rebuild(choice, acc, n: int) -> list[int]:
    """The tree behind values[n]: parents in breadth-first order (parents before children)."""
    parents: list[int] = []
    queue = [(-1, 0, n)]  # (parent node, depth index of its children, nodes for its children)
    while queue:
        parent, d, m = queue.pop(0)
        r = 0
        while m > 0 and d < len(acc) and r < len(acc[d]) and choice[d][r][m]:
            j = choice[d][r][m]
            parents.append(parent)
            queue.append((len(parents) - 1, d + 1, j - 1))
            m -= j
            r += 1
    return parents


def one_step_beyond(acc: Sequence[Sequence[float]]) -> list[list[float]]:
    """The measured table plus one untried level and one untried sibling rank, each assumed as good
    as the nearest measured cell: the deepest level's first rank one level deeper, each level's last
    rank once more. Unseen cells read as 0, so a table measured on small trees alone would value
    nothing beyond them and budgets would never grow past what was drafted before; with one step of
    optimism a bigger tree is tried when it would pay, and its measured cells then take over
    (docs/decisions/007-tree-budget.md). Example: [[0.8], [0.5]] -> [[0.8, 0.8], [0.5, 0.5], [0.5]]."""
    if not acc:
        return []
    return [list(row) + [row[-1]] for row in acc] + [[acc[-1][0]]]
