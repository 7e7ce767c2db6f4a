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
    values[n] = split(depth 1, rank 0, n). O(depth x ranks x n_max^2).
    """
    if n_max < 0:
        raise ValueError(f"n_max must be >= 0, got {n_max}")
    for d, row in enumerate(acc):
        for r, a in enumerate(row):
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance must be in [0, 1], got acc[{d}][{r}] = {a}")
    D = len(acc)
    # sub[d][m]: best value of an m-node subtree rooted at depth d + 1 (its root counts 1); split[d][r][m]
    # and the choice j that made it, for rebuilding the tree
    sub = [[0.0] * (n_max + 1) for _ in range(D)]
    split = [[[0.0] * (n_max + 1) for _ in range(len(acc[d]) + 1)] for d in range(D)]
    choice = [[[0] * (n_max + 1) for _ in range(len(acc[d]) + 1)] for d in range(D)]
    for d in range(D - 1, -1, -1):  # deepest level first: sub[d] needs split[d + 1], split[d] needs sub[d]
        for m in range(1, n_max + 1):
            sub[d][m] = 1.0 + (split[d + 1][0][m - 1] if d + 1 < D else 0.0)
        R = len(acc[d])
        for r in range(R - 1, -1, -1):
            for m in range(1, n_max + 1):
                best, pick = 0.0, 0
                for j in range(1, m + 1):
                    v = acc[d][r] * sub[d][j] + split[d][r + 1][m - j]
                    if v > best + 1e-12:
                        best, pick = v, j
                split[d][r][m], choice[d][r][m] = best, pick
    values = [split[0][0][n] if D else 0.0 for n in range(n_max + 1)]
    shapes = [_rebuild(choice, acc, n) for n in range(n_max + 1)]
    return values, shapes


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
