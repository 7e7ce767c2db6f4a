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
    n = best_budget(values, verify_time=t, draft_time=lambda n: 0.0)   # t(q): seconds for q rows

Worked example: acc = [[0.8, 0.1]] (depth 1 only: two candidates for the next token, no deeper
level). One node: the rank-0 child, 0.8 expected. Two nodes: both ranks, 0.8 + 0.1 = 0.9. A third
node has nowhere to go (depth 1 has two ranks), so values = [0, 0.8, 0.9, 0.9].
With acc = [[0.8], [0.5]] (a chain of two): values = [0, 0.8, 0.8 + 0.8 * 0.5 = 1.2].

The controller (specdec.controller) estimates ``acc`` per draft class from the trees it sees
verified (``PositionalAcceptance``) and asks ``best_budget`` how many nodes a tree drafter may
propose; the shapes are what Sequoia would draft (tree drafters here shape their own trees by draft
scores and take only the budget).
"""

from __future__ import annotations

from typing import Callable, Sequence


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
    rank once more. Unseen cells read as 0, so a table measured on small trees alone valued nothing
    beyond them and budgets never grew past what was drafted before (on the suffix drafter: 2 nodes
    while 8 paid); with one step of optimism a bigger tree is tried when it would pay, and its
    measured cells then take over. Example: [[0.8], [0.5]] -> [[0.8, 0.8], [0.5, 0.5], [0.5]]."""
    if not acc:
        return []
    return [list(row) + [row[-1]] for row in acc] + [[acc[-1][0]]]


def chain_values(rates: Sequence[float]) -> list[float]:
    """Expected accepted tokens of a chain of k = 0..len(rates) nodes, rates[d] the acceptance at
    depth d + 1 given the parent's: values[k] = sum over i <= k of rates[0] * ... * rates[i - 1].
    Example: [0.5, 0.8] -> [0, 0.5, 0.5 + 0.4 = 0.9]."""
    values, reach = [0.0], 1.0
    for r in rates:
        reach *= r
        values.append(values[-1] + reach)
    return values


def best_budget(values: Sequence[float], verify_time: Callable[[int], float],
                draft_time: Callable[[int], float], tie: float = 1.001) -> int:
    """The node budget n with the most tokens per second, (1 + values[n]) / (draft_time(n) +
    verify_time(1 + n)); n = 0 is plain decoding. A bigger tree must win by the factor ``tie``.
    Example: values [0, .8, .9, .9], verify 1.0 s for 1-2 rows and 1.3 s for 3-4, no draft cost ->
    n = 1 (1.8 per s; n = 2 gives 1.9 / 1.3 = 1.46)."""
    best, best_rate = 0, 1.0 / verify_time(1)
    for n in range(1, len(values)):
        rate = (1.0 + values[n]) / (draft_time(n) + verify_time(1 + n))
        if rate > best_rate * tie:
            best, best_rate = n, rate
    return best


class PositionalAcceptance:
    """acc[d][r] estimated from verified trees: for each node of a drafted tree whose parent was
    accepted (the pending token always is), one trial at (its depth, its sibling rank); a hit if
    the node itself was accepted. Counts decay by ``decay`` per observed tree, so the estimate
    follows the text. Unseen (depth, rank) cells read as 0 (not drafted, not valued).

    Example: tree parents [-1, -1, 0], the path accepted = [node 1]: trials (1, 0), (1, 1) -- node
    2's parent (node 0) was rejected, so node 2 was never judged -- hits (1, 1).
    """

    def __init__(self, max_depth: int = 16, max_rank: int = 8, decay: float = 0.98) -> None:
        self.max_depth, self.max_rank, self.decay = max_depth, max_rank, decay
        self.trials = [[0.0] * max_rank for _ in range(max_depth)]
        self.hits = [[0.0] * max_rank for _ in range(max_depth)]
        self.observed = 0

    def observe(self, parents: Sequence[int], accepted: Sequence[int], judged: int | None = None) -> None:
        """One row's tree (parents of its real nodes) and its accepted path (node indices, root down).
        judged: only nodes down to this depth were judged (a draft scored against the text committed
        after it, which is that long: ``tree.path_along``); deeper ones count for nothing."""
        if not parents:
            return
        self.observed += 1
        for row_t, row_h in zip(self.trials, self.hits):
            for r in range(self.max_rank):
                row_t[r] *= self.decay
                row_h[r] *= self.decay
        ok = set(accepted)
        depth, rank, seen = [], [], {}  # node depth (1 = child of pending), sibling rank
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
            rank.append(seen.get(p, 0))
            seen[p] = rank[-1] + 1
        for i, p in enumerate(parents):
            d, r = depth[i] - 1, rank[i]
            if (p < 0 or p in ok) and d < self.max_depth and r < self.max_rank and (judged is None or d < judged):
                self.trials[d][r] += 1.0
                self.hits[d][r] += 1.0 if i in ok else 0.0

    def observe_chain(self, drafted: int, accepted: int) -> None:
        """One row's chain (a tree with one rank per depth): ``drafted`` nodes, the first ``accepted``
        of them kept."""
        self.observe(list(range(-1, drafted - 1)), list(range(accepted)))

    def chain(self, depths: int, weight: float = 1.0) -> list[float]:
        """Acceptance of a chain's node at depths 1..``depths`` given its parent was accepted (rank
        0), each depth's hits / trials shrunk toward the depth above by ``weight`` pseudo-trials
        (depth 1: toward the rate over all depths): a depth never tried reads as the one above it
        (a flat tail, so a longer draft is tried when it would pay), and one miss in one trial does
        not read as 0 for good (it would keep that depth from ever being drafted again).

        The rate is not one alpha: prompt-lookup chains on Spec-Bench were accepted 0.37 at depth 1,
        0.63 at 2, 0.80 at 3 and ~0.9 from 6 on (a copied passage that matches one token goes on
        matching), where one alpha (~0.5) would stop drafting after ~3 tokens.
        Example: trials [10, 4], hits [5, 3], weight 1: pooled 8 / 14; depth 1 (5 + .571) / 11 = .506,
        depth 2 (3 + .506) / 5 = .701, depth 3 (untried) .701."""
        trials = sum(self.trials[d][0] for d in range(self.max_depth))
        prior = sum(self.hits[d][0] for d in range(self.max_depth)) / trials if trials > 0 else 1.0
        rates = []
        for d in range(depths):
            t, h = (self.trials[d][0], self.hits[d][0]) if d < self.max_depth else (0.0, 0.0)
            prior = (h + weight * prior) / (t + weight)
            rates.append(prior)
        return rates

    def table(self, min_trials: float = 0.5) -> list[list[float]]:
        """acc[d][r] = hits / trials, trimmed to the depths and ranks with trials (ranks of a depth
        stop at the first one never tried)."""
        acc = []
        for row_t, row_h in zip(self.trials, self.hits):
            row = []
            for t, h in zip(row_t, row_h):
                if t < min_trials:
                    break
                row.append(h / t)
            if not row:
                break
            acc.append(row)
        return acc
