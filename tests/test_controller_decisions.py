"""The controller's decisions are pinned: a seeded random drive of every question (chain and tree plans,
choices among several sources, shadow sizes) and every observation (new runs, batch changes, verified
steps, trees, shadow drafts) must give the budgets, choices and acceptance rates recorded from the
controller before it became a package (tests/controller_decisions.json). Each question's plan is taken
(``observe``) as the decoder takes it, so the pin replays the decoder's sequence of decisions; and a
question asked changes nothing until its plan is observed (checked on the same drive).

A pin, not a check: it says that a decision changed, not whether the new one is right, and a deliberate
change re-records it. What the decisions must be, whatever was recorded, is checked in
tests/test_controller_properties.py (BASS's schedule, longer drafts for better-accepted classes, a
priced-out class stopping but for ever sparser probes, sources revisited when due, ...).

To re-record after a deliberate change of behaviour: ``python tests/test_controller_decisions.py``.
"""

import json
import pickle
import random
from pathlib import Path

import pytest

from specdec.controller import DraftLengthConfig, DraftLengthController

RECORD = Path(__file__).with_name("controller_decisions.json")
KEYS = [None, ("lookup", 1), ("lookup", 3), "eagle", "suffix"]
CONFIGS = {
    "default": lambda: DraftLengthConfig(),
    "bass": lambda: DraftLengthConfig.bass(),
    "fixed-tree": lambda: DraftLengthConfig(cost_aware=False, adaptive=False, tree_nodes=5),
    "short": lambda: DraftLengthConfig(maximum=6, min_samples=2, explore_every=3, revisit_every=10),
}
STEPS = 700


def _tree(rng, n):
    """Random parents of n nodes (each parent before its child) and an accepted path down them."""
    parents = [rng.randrange(-1, i) for i in range(n)]
    path, node, hit = [], -1, rng.random()
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids or rng.random() > hit:
            return parents, path
        node = rng.choice(kids)
        path.append(node)


def _verify_seconds(rng, q, batch):
    return (1.0 + 0.05 * batch * (q - 1)) * (1.0 + 0.3 * rng.random()) * (3.0 if rng.random() < 0.03 else 1.0)


def _step(rng, c, key, n, batch, out):
    """Draft n nodes (a chain or a tree) of class key on some rows, verify, tell the controller."""
    trees = [_tree(rng, n) if n and (batch == 1 or rng.random() < 0.7) else ([], []) for _ in range(batch)]
    if rng.random() < 0.5:  # a chain: the same counts through observe_tree's chain form
        trees = [(list(range(-1, len(p) - 1)), list(range(min(len(a), len(p))))) for p, a in trees]
    drafted, accepted = [len(p) for p, _ in trees], [len(a) for _, a in trees]
    q = 1 + max(drafted)
    draft = None if rng.random() < 0.1 else 0.02 * n * rng.random()
    c.update(drafted, accepted, _verify_seconds(rng, q, batch), draft, key, grew=rng.random() < 0.05,
             resume=0.1 * rng.random() if rng.random() < 0.1 else 0.0,
             catch_up=0.2 * rng.random() if rng.random() < 0.1 else 0.0)
    if any(drafted):
        c.observe_tree([p for p, _ in trees], [a for _, a in trees], key)


def drive(config, seed, steps=STEPS, pure=False):
    """Every decision a controller makes on a seeded random schedule: a list of numbers and keys. With
    ``pure``, each question is asked twice and must leave the controller as it was (pickled) and
    answer the same plan."""
    rng, c, out = random.Random(seed), DraftLengthController(config), []

    def take(ask):
        """Ask (``ask()`` returns a Plan), then follow the plan: the decoder's order."""
        before = pickle.dumps(c) if pure else None
        plan = ask()
        if pure:
            assert pickle.dumps(c) == before, "a question changed the controller"
            assert ask() == plan, "a question answered twice differently"
        c.observe(plan)
        return plan

    batch = 1
    c.new_run(batch)
    for step in range(steps):
        if step % 20 == 0:
            out.append([c.alpha, c.state(("lookup", 1)).alpha])
        r = rng.random()
        if r < 0.02:
            batch = rng.choice([1, 2, 8])
            c.new_run(batch)
        elif r < 0.05 and batch > 1:
            batch -= rng.randrange(1, batch)
            c.set_batch(batch)
        key = rng.choice(KEYS)
        op = rng.random()
        if op < 0.35:
            n = take(lambda: c.plan(key)).size
            out.append(n)
            _step(rng, c, key, n, batch, out)
        elif op < 0.6:
            cap = rng.choice([0, 4, 12, 24])
            n = take(lambda: c.plan(key, cap, tree=True)).size
            out.append(n)
            _step(rng, c, key, n, batch, out)
        elif op < 0.8:
            keys = rng.sample(KEYS, rng.randrange(1, len(KEYS) + 1))
            free = [k for k in keys if rng.random() < 0.3]
            tree = {k: rng.random() < 0.5 for k in keys}
            plan = take(lambda: c.choose(keys, lambda k: c.plan(k, 12, tree=True) if tree[k] else c.plan(k), free))
            out.append([KEYS.index(plan.key) if plan.key in KEYS else -1, plan.size])
            _step(rng, c, plan.key, plan.size, batch, out)
        else:
            tree = rng.random() < 0.5
            cap = rng.choice([0, 3, 10])
            n = take(lambda: c.plan_shadow(cap, key, tree=tree)).size
            out.append(n)
            rows = [_tree(rng, n) if n and rng.random() < 0.8 else ([], []) for _ in range(batch)]
            judged = [rng.randrange(len(a), len(a) + 3) for _, a in rows]
            c.observe_shadow([p for p, _ in rows], [a for _, a in rows], judged,
                             None if rng.random() < 0.2 else 1e-4 * rng.random(), key)
            _step(rng, c, None, 0, batch, out)  # the plain step beside the shadow
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_plans_taken_replay_the_recorded_decisions(name, seed):
    expected = json.loads(RECORD.read_text())[f"{name}/{seed}"]
    got = json.loads(json.dumps(drive(CONFIGS[name](), seed)))  # the same float and list forms
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert first is None and len(got) == len(expected), f"decision {first} differs: {got[first]} != {expected[first]}"


@pytest.mark.parametrize("name", ["default", "short"])
def test_questions_change_nothing_until_their_plan_is_observed(name):
    """The recorded drive again, each question asked twice before its plan is taken: asking leaves the
    controller byte for byte as it was and answers alike (the decisions still replay)."""
    expected = json.loads(RECORD.read_text())[f"{name}/0"]
    got = json.loads(json.dumps(drive(CONFIGS[name](), 0, steps=300, pure=True)))
    assert got == expected[: len(got)]  # the first 300 steps' decisions


if __name__ == "__main__":
    RECORD.write_text(json.dumps({f"{n}/{s}": drive(CONFIGS[n](), s) for n in sorted(CONFIGS) for s in (0, 1)}))
