"""Choosing among several draft classes (the sources of ``drafters.chooser.Sources``, ``auto``): which one drafts this step.

Why this order: docs/decisions/009-shadow-drafts.md (free sources measured by shadow drafts) and
docs/decisions/006-draft-length.md (the gate, ``min_samples``).
"""

from __future__ import annotations

from typing import Callable, Collection, Hashable

from specdec.controller.tables import ClassState


def ask_order(keys: list[Hashable], states: dict[Hashable, ClassState], free: Collection[Hashable], min_samples: int,
              revisit_every: int) -> tuple[list[Hashable], list[Hashable], list[Hashable]]:
    """(fresh, due, rest): the classes in the order they are asked.
    fresh: fewer than ``min_samples`` measured drafting steps, the least measured first, except the
    ``free`` ones (measured by their shadow drafts without drafting); due: passed over
    ``revisit_every`` times and not shadowed this run (their gain may be stale); rest: by measured
    gain, best first (unmeasured as 0).
    Example: gains {a: 1.4, b: 1.1, c: None (0 samples)}, nothing due -> ([c], [], [a, b])."""
    fresh = sorted((k for k, st in states.items() if st.gain_samples < min_samples and k not in free),
                   key=lambda k: states[k].gain_samples)
    due = [k for k, st in states.items() if st.idle >= revisit_every and k not in fresh and not st.shadowed]
    rest = sorted((k for k in keys if k not in fresh and k not in due), key=lambda k: -(states[k].gain or 0.0))
    return fresh, due, rest


def choose(keys: list[Hashable], states: dict[Hashable, ClassState], size: Callable[[Hashable], int],
           free: Collection[Hashable], min_samples: int, revisit_every: int,
           pays: Callable[[ClassState], bool]) -> tuple[Hashable | None, int, list[Hashable]]:
    """(class, ``size(class)``, the classes asked) for the first of ``keys`` (``states``: theirs) in
    ``ask_order`` whose rule drafts something, or (None, 0, asked). A class of ``rest`` that says 0 passes
    the step on, until one that does not pay (``pays``) said 0: every class after it gains less, so it
    drafts nothing either. Changes nothing: the caller resets the idle count of every class asked and
    counts one more step passed over for the others.
    Example: gains {"lookup": 1.4, "eagle": 1.1} -> "lookup"; lookup says 0 -> "eagle"; after
    ``revisit_every`` steps of "lookup", "eagle" once."""
    if not keys:
        return None, 0, []
    fresh, due, rest = ask_order(keys, states, free, min_samples, revisit_every)
    asked, pick, n = [], None, 0
    for k in fresh + due + rest:
        asked.append(k)
        n = size(k)
        if n > 0:
            pick = k
            break
        if k in rest and not pays(states[k]):
            break
    return pick, n, asked  # n is 0 when no class drafts: the last one asked said so
