"""Sequoia's tree sizing: the dynamic program against hand-checked cases and a brute force."""

import itertools
import random

import pytest

from specdec.controller.cost import best_budget
from specdec.controller.sequoia import best_trees, best_values, one_step_beyond
from specdec.controller.tables import PositionalAcceptance


def tree_value(parents, acc):
    """Expected accepted tokens of a tree: the sum over nodes of the product of acc along the path."""
    depth, rank, seen, value, total = [], [], {}, [], 0.0
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
        rank.append(seen.get(p, 0))
        seen[p] = rank[-1] + 1
        v = acc[depth[-1] - 1][rank[-1]] * (1.0 if p < 0 else value[p])
        value.append(v)
        total += v
    return total


def all_trees(n, acc):
    """Every rank-ordered tree of exactly n nodes that fits acc's depths and ranks (parents lists)."""
    out = []

    def grow(parents, frontier_depths):
        if len(parents) == n:
            out.append(list(parents))
            return
        # add the next node as the next-rank child of any existing node (or the root) whose depth allows;
        # canonical order (parents non-decreasing) avoids listing one tree many times
        start = parents[-1] if parents else -1
        for p in range(start, len(parents)):
            d = 1 if p < 0 else frontier_depths[p] + 1
            r = sum(1 for q in parents if q == p)
            if d <= len(acc) and r < len(acc[d - 1]):
                grow(parents + [p], frontier_depths + [d])

    grow([], [])
    return out


def test_hand_checked_acceptance_vectors():
    values, shapes = best_trees([[0.8, 0.1]], 3)
    assert values == pytest.approx([0.0, 0.8, 0.9, 0.9]) and shapes[2] == [-1, -1]
    values, shapes = best_trees([[0.8], [0.5]], 2)
    assert values == pytest.approx([0.0, 0.8, 1.2]) and shapes[2] == [-1, 0]
    # a strong first guess: the third node goes deeper (0.9 * 0.9 = 0.81) rather than wider (0.05)
    values, shapes = best_trees([[0.9, 0.05, 0.01], [0.9, 0.05, 0.01], [0.9, 0.05, 0.01]], 3)
    assert shapes[3] == [-1, 0, 1] and values[3] == pytest.approx(0.9 + 0.81 + 0.729)
    # a weak first guess: the second node is a sibling (0.3) rather than a child (0.4 * 0.4 = 0.16)
    values, shapes = best_trees([[0.4, 0.3, 0.1], [0.4, 0.3, 0.1]], 2)
    assert shapes[2] == [-1, -1] and values[2] == pytest.approx(0.7)


def test_dynamic_program_matches_brute_force_on_random_acceptance():
    rng = random.Random(0)
    for _ in range(60):
        D, R = rng.randint(1, 3), rng.randint(1, 3)
        acc = [[rng.random() for _ in range(R)] for _ in range(D)]
        n_max = rng.randint(1, 6)
        values, shapes = best_trees(acc, n_max)
        for n in range(n_max + 1):
            best = max((tree_value(t, acc) for m in range(n + 1) for t in all_trees(m, acc)), default=0.0)
            assert values[n] == pytest.approx(best), (acc, n)
            assert len(shapes[n]) <= n and tree_value(shapes[n], acc) == pytest.approx(values[n])
            assert all(p < i for i, p in enumerate(shapes[n]))


def scalar_program(acc, n_max):
    """The recursion of ``best_trees``' docstring, one (depth, rank, m, j) at a time: the values."""
    D = len(acc)
    split = [[[0.0] * (n_max + 1) for _ in range(len(acc[d]) + 1)] for d in range(D)]
    for d in range(D - 1, -1, -1):
        sub = [0.0] + [1.0 + (split[d + 1][0][m - 1] if d + 1 < D else 0.0) for m in range(1, n_max + 1)]
        for r in range(len(acc[d]) - 1, -1, -1):
            for m in range(1, n_max + 1):
                split[d][r][m] = max([0.0] + [acc[d][r] * sub[j] + split[d][r + 1][m - j] for j in range(1, m + 1)])
    return [split[0][0][n] if D else 0.0 for n in range(n_max + 1)]


def test_vector_program_is_the_recursion_at_the_controllers_sizes():
    """Tables as deep and wide as the controller's (up to 12 levels, 5 ranks, 33 nodes), with exact 0, 1/2 and
    1 cells (ties): the vector steps give the scalar recursion's values, and each tree is worth its value."""
    rng = random.Random(2)
    for _ in range(150):
        acc = [[rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(1, 5))]
               for _ in range(rng.randint(0, 12))]
        n_max = rng.randint(0, 33)
        values, shapes = best_trees(acc, n_max)
        assert best_values(acc, n_max) == values
        assert values == pytest.approx(scalar_program(acc, n_max), abs=1e-9)
        for n in range(n_max + 1):
            assert tree_value(shapes[n], acc) == pytest.approx(values[n], abs=1e-9)


def test_budget_trades_expected_tokens_against_measured_verify_time():
    values = [0.0, 0.8, 0.9, 0.9]
    steps = {1: 1.0, 2: 1.0, 3: 1.3, 4: 1.3}
    assert best_budget(values, steps.__getitem__, lambda n: 0.0) == 1
    flat = best_budget(values, lambda q: 1.0, lambda n: 0.0)
    assert flat == 2  # verifies cost nothing extra: take every node that adds value
    assert best_budget(values, lambda q: 1.0 * q, lambda n: 0.0) == 0  # each row costs a step: never pays
    # more nodes where a verify is cheap relative to a step (long context), fewer where it is not
    long = [0.0] + [sum(0.7 ** k for k in range(1, n + 1)) for n in range(1, 17)]
    cheap = best_budget(long, lambda q: 1.0 + 0.01 * q, lambda n: 0.0)
    dear = best_budget(long, lambda q: 1.0 + 0.15 * q, lambda n: 0.0)
    assert cheap > dear >= 1


def test_positional_acceptance_counts_trials_only_under_accepted_parents():
    pa = PositionalAcceptance(decay=1.0)
    pa.observe([-1, -1, 0], [1])
    assert pa.trials[0][:2] == [1.0, 1.0] and pa.hits[0][:2] == [0.0, 1.0] and pa.trials[1][0] == 0.0
    pa.observe([-1, 0, 1], [0, 1])
    assert pa.table() == [[0.5, 1.0], [1.0], [0.0]]


def test_measured_table_drives_the_program_toward_the_shape_that_was_accepted():
    rng = random.Random(1)
    true = [[0.7, 0.2, 0.05], [0.7, 0.2, 0.05], [0.7, 0.2, 0.05]]
    pa = PositionalAcceptance(decay=1.0, max_depth=3, max_rank=3)
    full = [-1, -1, -1, 0, 0, 0, 3, 3, 3]  # every (depth, rank) cell drafted
    for _ in range(4000):
        path, node = [], -1
        while True:  # the target walks down: the first child (in rank order) it accepts
            kids = [i for i, p in enumerate(full) if p == node]
            if not kids:
                break
            d = 0 if node < 0 else (1 if full[node] < 0 else 2)
            pick = next((k for r, k in enumerate(kids) if rng.random() < true[d][r] / max(1e-9, 1 - sum(true[d][:r]))), None)
            if pick is None:
                break
            path.append(pick)
            node = pick
        pa.observe(full, path)
    measured = pa.table()
    for row_m, row_t in zip(measured, true):
        assert row_m == pytest.approx(row_t, abs=0.04)
    assert best_trees(measured, 3)[1][3] == best_trees(true, 3)[1][3]


def test_bad_acceptance_is_refused():
    with pytest.raises(ValueError, match="acceptance"):
        best_trees([[1.5]], 2)
    with pytest.raises(ValueError, match="n_max"):
        best_trees([[0.5]], -1)


def test_one_step_beyond_lets_the_budget_grow_past_the_trees_drafted_so_far():
    """Only 2-node stars drafted so far (depth 1, ranks 0-1 measured): the table values nothing
    deeper or wider that pays, so with verify rows nearly free the budget stays at 1; with one untried
    level and rank assumed as good as their neighbours it grows, and the next trees measure them."""
    pa = PositionalAcceptance(decay=1.0)
    for i in range(40):
        pa.observe([-1, -1], [0] if i % 5 else [])  # the first child accepted 4 times in 5
    measured = pa.table()
    assert measured == [[pytest.approx(0.8), 0.0]]
    cheap = lambda q: 1.0 + 0.02 * q  # noqa: E731  8 rows cost ~1.16x a step
    assert best_budget(best_trees(measured, 8)[0], cheap, lambda n: 0.0) == 1
    wider = one_step_beyond(measured)
    assert wider == [[pytest.approx(0.8), 0.0, 0.0], [pytest.approx(0.8)]]
    assert best_budget(best_trees(wider, 8)[0], cheap, lambda n: 0.0) == 2  # a child of the first guess
    assert one_step_beyond([]) == []
