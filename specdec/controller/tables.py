"""What the controller measures, as small tables: running means of seconds and rates, verify times per
batch size and block size, acceptance per draft depth and sibling rank, and what is known of each
draft class (its rates, gains per batch size, draft seconds per size, schedules).

Every estimate is an exponentially decayed mean (``running_mean``), so it follows the text and the
machine; seconds are clipped on the way in (``running_time``) so one stalled step cannot move them far.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def running_mean(old: float | None, sample: float, decay: float) -> float:
    """An exponentially decayed mean: the first sample as it is (old None), then decay * old +
    (1 - decay) * sample. Example: old 1.0, sample 2.0, decay 0.8 -> 1.2."""
    return sample if old is None else decay * old + (1 - decay) * sample


def running_time(old: float | None, sample: float, decay: float) -> float:
    """A running mean of seconds in which a sample counts at most 1.5x the estimate: one slow step
    moves the mean by at most (1 - decay) x 0.5 of it (10% at decay 0.8); a lasting change still comes
    through, step by step. Example: old 1.0, sample 5.0, decay 0.8 -> 0.8 + 0.2 x 1.5 = 1.1.
    Why clipped: docs/decisions/006-draft-length.md."""
    return sample if old is None else running_mean(old, min(sample, 1.5 * old), decay)


def nearest_batch(sizes: Iterable[int], batch: int) -> int | None:
    """The batch size nearest ``batch`` on a log scale (ties to the larger), None if there is none.
    Example: {1, 8} for 2 -> 1 (log 2 < log 4), for 3 -> 8; {2, 8} for 4 -> 8 (a tie)."""
    return min(sizes, key=lambda b: (abs(math.log(b / batch)), -b), default=None)


def gain_mean(mean: float | None, samples: int, gain: float, decay: float) -> tuple[float, int]:
    """(mean, samples) after one more drafting step's gain: the plain mean of the first 1 / (1 - decay)
    steps (weight 1 / (samples + 1)), the running mean with weight 1 - decay after.
    Example: gains 0.5 then 2.0 -> 1.25; a good probe or two reopen a gate one poor step closed."""
    w = max(1.0 - decay, 1.0 / (samples + 1))
    return (gain if mean is None else (1.0 - w) * mean + w * gain), samples + 1


class BatchGains:
    """The measured gain of every drafting step at each batch size > 1, whatever its class: what drafting
    has paid at that batch size (``DraftLengthController.priced_out``). At a batch every row pays for
    the widest row's block, so the batch's drafting steps are judged together."""

    def __init__(self) -> None:
        self.by_batch: dict[int, tuple[float, int]] = {}  # batch size -> (mean gain, drafting steps)

    def add(self, batch_size: int, gain: float, decay: float) -> None:
        self.by_batch[batch_size] = gain_mean(*self.by_batch.get(batch_size, (None, 0)), gain, decay)

    def near(self, batch_size: int, min_samples: int) -> float | None:
        """The mean gain at the batch size nearest ``batch_size`` measured over ``min_samples`` steps or
        more (``nearest_batch``), None if none is. Example: {8: (0.9, 12), 16: (1.2, 2)}, 16, 8 -> 0.9."""
        b = nearest_batch([b for b, (_, n) in self.by_batch.items() if n >= min_samples], batch_size)
        return None if b is None else self.by_batch[b][0]


class VerifyTimes:
    """Mean verify seconds per block size q (rows per sequence: the pending token plus the drafted
    nodes), one table per batch size: at batch B a verify runs B x q rows, so each batch size has its
    own cost curve. ``live`` is the table of the batch being decoded."""

    def __init__(self) -> None:
        self.by_batch: dict[int, dict[int, float]] = {1: {}}  # batch size -> (q -> seconds)
        self.live: dict[int, float] = self.by_batch[1]

    def select(self, batch_size: int) -> None:
        self.live = self.by_batch.setdefault(batch_size, {})

    def record(self, q: int, seconds: float, grew: bool, decay: float) -> None:
        """One verify of q rows per sequence took ``seconds``. A step that grew the store (a copy every
        block size pays alike) is not a sample of its size's cost unless the size has none yet; and
        fewer rows never cost more: smaller sizes timed dearer are lowered to this size's mean.
        Example: live {1: 1.3, 2: 1.1}, record(4, 1.1) -> {1: 1.1, 2: 1.1, 4: 1.1}."""
        t = self.live
        if grew and q in t:
            return
        t[q] = running_time(t.get(q), seconds, decay)
        for smaller, s in t.items():
            if smaller < q and s > t[q]:
                t[smaller] = t[q]

    def probe_table(self, batch_size: int) -> dict[int, float] | None:
        """The table of the batch size nearest ``batch_size`` where both a 1-row and a 2-row block were
        timed (what a one-token probe costs; a batch that just lost a row costs about the same)."""
        timed = [b for b, t in self.by_batch.items() if 1 in t and 2 in t]
        b = nearest_batch(timed, batch_size)
        return None if b is None else self.by_batch[b]


class PositionalAcceptance:
    """acc[d][r], the chance that the rank-r child (0 = the drafter's best guess) at depth d + 1 of an
    accepted node is accepted (Sequoia's positional acceptance), estimated from verified trees: for
    each node whose parent was accepted (the pending token always is), one trial at (its depth, its
    sibling rank); a hit if the node itself was accepted. Counts decay by ``decay`` per observed tree,
    so the estimate follows the text. Unseen (depth, rank) cells read as 0 (not drafted, not valued).

    Example: tree parents [-1, -1, 0], the path accepted = [node 1]: trials (1, 0), (1, 1) -- node
    2's parent (node 0) was rejected, so node 2 was never judged -- hits (1, 1).
    """

    def __init__(self, max_depth: int = 16, max_rank: int = 8, decay: float = 0.98) -> None:
        self.max_depth, self.max_rank, self.decay = max_depth, max_rank, decay
        self.trials = [[0.0] * max_rank for _ in range(max_depth)]
        self.hits = [[0.0] * max_rank for _ in range(max_depth)]
        self.observed = 0
        self.used = (0, 0)  # (depths, ranks) ever tried: the cells past them are 0 and stay 0 under the decay

    def observe(self, parents: Sequence[int], accepted: Sequence[int], judged: int | None = None) -> None:
        """One row's tree (parents of its real nodes) and its accepted path (node indices, root down).
        judged: only nodes down to this depth were judged (a draft scored against the text committed
        after it, which is that long: ``tree.path_along``); deeper ones count for nothing."""
        if not parents:
            return
        self.observed += 1
        depths, ranks = self.used
        for d in range(depths):  # the decay, over the cells ever tried (a chain's: one rank)
            row_t, row_h = self.trials[d], self.hits[d]
            for r in range(ranks):
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
                depths, ranks = max(depths, d + 1), max(ranks, r + 1)
        self.used = (depths, ranks)

    def observe_chain(self, drafted: int, accepted: int) -> None:
        """One row's chain (a tree with one rank per depth): ``drafted`` nodes, the first ``accepted``
        of them kept."""
        self.observe(list(range(-1, drafted - 1)), list(range(accepted)))

    def chain(self, depths: int, weight: float = 1.0) -> list[float]:
        """Acceptance of a chain's node at depths 1..``depths`` given its parent was accepted (rank
        0), each depth's hits / trials shrunk toward the depth above by ``weight`` pseudo-trials
        (depth 1: toward the rate over all depths): a depth never tried reads as the one above it
        (a flat tail, so a longer draft is tried when it would pay), and one miss in one trial does
        not read as 0 for good. One rate per depth, not one alpha: docs/decisions/006-draft-length.md.
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


class ClassState:
    """What the controller has learned about one draft class (the key a drafter gives per step: prompt
    lookup's matched n-gram size, a source of ``auto``), and its per-answer schedules."""

    __slots__ = ("alpha", "length", "skipped", "interval", "gain", "gain_samples", "shrinks", "positions",
                 "values", "idle", "draft_by_size", "probing", "probe_length", "whole", "shadowed",
                 "row_share", "catch_up", "resume", "gains")

    def __init__(self, initial: int, explore_every: int, tree_decay: float) -> None:
        self.alpha: float | None = None  # accepted over judged drafted tokens (running), None until measured
        # running measured gain of a drafting step over a plain step of the live batch (tokens per
        # sequence over seconds in plain steps, ``cost.step_gain``); None until measured
        self.gain: float | None = None
        self.gain_samples = 0  # drafting steps measured: their plain mean until the running mean's memory
        self.gains: dict[int, tuple[float | None, int]] = {}  # other batch sizes' (gain, gain_samples)
        self.length = initial  # BASS's draft length
        self.skipped = 0  # steps gated off since the last draft
        self.interval = explore_every  # steps between probes; doubles while probes fail
        self.shrinks = 0  # consecutive steps the length shrank (BASS's schedule cuts more each time)
        self.positions = PositionalAcceptance(decay=tree_decay)  # acceptance per depth and sibling rank
        self.values: list[float] | None = None  # Sequoia's expected accepted drafts per node budget
        self.idle = 0  # steps this class was a candidate (``choose``) and another was picked
        self.draft_by_size: dict[int, float] = {}  # running seconds of a whole draft per size (nodes)
        self.probing = False  # the step being drafted is a probe (the gate or the length rule said no)
        self.probe_length = 1  # a chain probe's length at batch 1: +step_up after one taken whole
        self.whole = 0  # the length of the last draft if every row took it whole, else 0
        self.shadowed = False  # this run scores unverified drafts of the class (``observe_shadow``)
        self.row_share: float | None = None  # at a batch: running share of rows that drafted in the class
        self.catch_up = 0.0  # running seconds the source spent catching up when it drafted (prompts included)
        self.resume = 0.0  # the same, of its catch-ups after a pause only (text committed while it did not draft)

    def switch_batch(self, old: int, new: int) -> None:
        """Keep the measured gain of batch size ``old``; take ``new``'s, or the nearest measured size's
        (``nearest_batch``), or none. Example: gains at {1: 2.1, 8: 0.9}, new 6 -> 8's 0.9."""
        self.gains[old] = (self.gain, self.gain_samples)
        measured = [b for b, (g, _) in self.gains.items() if g is not None]
        near = nearest_batch(measured, new)
        self.gain, self.gain_samples = self.gains[near] if near is not None else (None, 0)

    def add_gain(self, gain: float, gate_decay: float) -> None:
        """One drafting step's gain into the mean (``gain_mean``)."""
        self.gain, self.gain_samples = gain_mean(self.gain, self.gain_samples, gain, gate_decay)
