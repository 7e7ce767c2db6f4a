"""The chat page's live panel: the engine's counters now, and their rates over the last minutes.

``GET /stats`` answers ``snapshot(...)``: the same counters ``/metrics`` reports (live rows, queue,
tokens/s over the last 10 s, tau, drafted and accepted tokens per drafter), plus ``history``: one
point per ``SAMPLE_EVERY`` seconds over the last ``KEEP`` seconds, each the tokens/s and every
drafter's acceptance (accepted / drafted) within that interval (None where it drafted nothing). The
app records a ``Sample`` every ``SAMPLE_EVERY`` seconds, whether or not a page is watching, so a page
opened late still sees the last minutes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

SAMPLE_EVERY = 5.0  # seconds between two points of the panel's charts
KEEP = 600.0  # seconds of points kept: the charts' width


@dataclass(frozen=True)
class Sample:
    """The engine's cumulative counters at one time."""

    at: float  # time.perf_counter()
    tokens: int  # generated so far
    drafted: dict  # drafter -> drafted tokens verified so far
    accepted: dict  # drafter -> of them, kept

    @classmethod
    def of(cls, counters, at: float) -> "Sample":
        # dict(d) copies in one C call, under the GIL: the engine thread cannot add a key halfway
        return cls(at, counters.tokens, dict(counters.drafted), dict(counters.accepted))


class History:
    """Samples of the last ``keep`` seconds; ``points(now)`` their rates per interval."""

    def __init__(self, keep: float = KEEP) -> None:
        self.keep = keep
        self.samples: deque[Sample] = deque()

    def record(self, sample: Sample) -> None:
        self.samples.append(sample)
        while self.samples and self.samples[0].at < sample.at - self.keep - SAMPLE_EVERY:
            self.samples.popleft()  # (one point older than keep stays: the first interval's start)

    def points(self, now: float) -> list[dict]:
        """Oldest first: {"age": seconds before now the interval ended, "tokens_per_second",
        "acceptance": {drafter: accepted / drafted in the interval, or None}}."""
        out, samples = [], list(self.samples)
        for a, b in zip(samples, samples[1:]):
            seconds = b.at - a.at
            if seconds <= 0:
                continue
            acceptance = {}
            for name, drafted in b.drafted.items():
                d = drafted - a.drafted.get(name, 0)
                acceptance[name] = (b.accepted.get(name, 0) - a.accepted.get(name, 0)) / d if d > 0 else None
            out.append({"age": round(now - b.at, 3), "tokens_per_second": (b.tokens - a.tokens) / seconds,
                        "acceptance": acceptance})
        return out


def snapshot(engine, history: History, max_batch: int, now: float | None = None) -> dict:
    """What the live panel shows (``GET /stats``): the numbers of /metrics, and the history's points."""
    now = time.perf_counter() if now is None else now
    c = engine.counters
    drafted, accepted = dict(c.drafted), dict(c.accepted)
    drafters = [{"name": name, "drafted": n, "accepted": accepted.get(name, 0),
                 "rate": accepted.get(name, 0) / n if n else None} for name, n in sorted(drafted.items())]
    return {"batch_size": c.batch_size, "max_batch": max_batch, "queue_length": engine.queue_length,
            "tokens_per_second": c.tokens_per_second(now), "tau": c.tokens / max(1, c.sequence_steps),
            "generated_tokens": c.tokens, "steps": c.steps, "requests": dict(c.finished), "drafters": drafters,
            "history": history.points(now), "sample_every": SAMPLE_EVERY}
