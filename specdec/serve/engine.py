"""The server's decode loop: one worker thread steps a ``DecodeSession`` over every live request.

    engine = Engine(decoder, eos={2}, config=EngineConfig(max_batch=8))
    engine.start()
    handle = engine.submit(Request(prompt_ids, max_new=64, sampling=None, seed=None, emit=on_update))
    engine.cancel(handle)            # the row leaves at the next step boundary
    engine.stop(deadline=10.0)       # finish in-flight requests within the deadline, cancel the rest

Between two steps the thread drops cancelled rows, prefills the waiting requests that fit the batch
(``max_batch`` live rows) and joins them to it (continuous batching), then runs one step for every
live row; each row accepts its own drafts (``specdec.session``), stops on its own and leaves. A
request's updates (new tokens, then a finish reason) go to its ``emit`` on this thread: the HTTP side
hands them to its event loop. The waiting queue is bounded (``max_queue``): beyond it ``submit``
raises ``Busy``. Drafters that read hidden states (EAGLE) cannot restart mid-batch
(``DecodeSession.joins``): with them requests join only an empty batch (waves).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.processing import Processing
from specdec.sampling import SamplingParams
from specdec.serve.acceptance import RowAcceptance, RowRule
from specdec.session import DecodeSession, StepEvent

log = logging.getLogger("specdec.serve")
RATE_WINDOW = 10.0  # seconds of steps the tokens/s gauge averages over


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # live rows at most (a CPU verify over 8 rows x 17 nodes is already ~2x a step of 1)
    max_queue: int = 64  # requests waiting for a row at most; beyond it submit() raises Busy (HTTP 429)
    retry_after: int = 1  # seconds a refused client is told to wait (Retry-After)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0 or self.retry_after < 0:
            raise ValueError(f"need max_batch >= 1, max_queue >= 0, retry_after >= 0: {self}")


class Busy(Exception):
    """The queue is full, or the engine is shutting down: try again later (HTTP 429 / 503)."""

    def __init__(self, message: str, retry_after: int, shutting_down: bool = False) -> None:
        super().__init__(message)
        self.retry_after, self.shutting_down = retry_after, shutting_down


@dataclass(frozen=True)
class Update:
    tokens: list[int]  # new tokens of the answer (may be empty with a finish)
    finish: str | None = None  # None: more to come; "stop" (EOS), "length", "cancelled", "error"
    from_draft: int = 0  # leading tokens that were accepted drafts
    error: str | None = None
    drafted: int = 0  # draft tokens verified for this request in the step (>= from_draft)
    source: str | None = None  # the drafter whose draft the step verified for it (None: nothing drafted)
    logprobs: list | None = None  # one ``TokenLogprob`` per token, when the request asked for them
    cached: int = 0  # prompt tokens taken from the prefix cache (on the request's first update only)


@dataclass
class Request:
    prompt: list[int]  # token ids
    max_new: int  # >= 1, within the context window (the HTTP side checked)
    sampling: SamplingParams | None  # None: greedy
    seed: int | None  # sampled rows: the noise stream's seed (None: a random one)
    emit: Callable[[Update], None]  # called on the engine thread
    # penalties, biases, a compiled constraint and logprobs (``specdec.processing``); None: none
    processing: Processing | None = None
    answer: list[int] = field(default_factory=list)  # what was emitted so far
    handle: int = -1  # set by submit: unique for the engine's life (an id() could be reused)
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class Counters:
    """What /metrics reports; written by the engine thread only (plain ints: reads may lag a step)."""

    tokens: int = 0  # tokens generated, all requests
    sequence_steps: int = 0  # target forwards summed over rows (tau = tokens / sequence_steps)
    steps: int = 0  # batched steps (one target forward each)
    joins: int = 0  # admissions into a batch with live rows (continuous batching at work)
    finished: dict = field(default_factory=dict)  # finish reason -> requests
    drafted: dict = field(default_factory=dict)  # source -> drafted nodes verified
    accepted: dict = field(default_factory=dict)  # source -> drafted tokens kept
    batch_size: int = 0
    recent: deque = field(default_factory=deque)  # (time, tokens) of the last RATE_WINDOW seconds

    def prune(self, now: float) -> None:
        """Drops what fell out of the window (the engine thread only: two threads popping could pop twice)."""
        while self.recent and self.recent[0][0] < now - RATE_WINDOW:
            self.recent.popleft()

    def tokens_per_second(self, now: float) -> float:
        """Any thread (/metrics, /stats): reads a copy (list() copies in one C call, under the GIL;
        iterating the deque itself while the engine thread appends would raise)."""
        return sum(n for t, n in list(self.recent) if t >= now - RATE_WINDOW) / RATE_WINDOW


class Engine:
    def __init__(self, decoder, eos: set[int], config: EngineConfig = EngineConfig(),
                 on_finished: Callable[[list[int], list[int]], None] | None = None) -> None:
        self.decoder, self.eos, self.config = decoder, set(eos), config
        self.on_finished = on_finished  # (prompt, answer) of each finished request, on the engine thread
        self.session = DecodeSession(decoder, self.eos, record_steps=False)
        self.counters = Counters()
        self._cv = threading.Condition()
        self._queue: deque[Request] = deque()
        self._cancel: set[int] = set()  # ids of requests to cancel
        self._calls: list[Callable[[], None]] = []
        self._live: dict[int, Request] = {}  # sequence id -> request
        self._stopping = False
        self._deadline = float("inf")
        self._thread: threading.Thread | None = None
        self._handles = itertools.count()

    # -- the HTTP side's verbs (any thread)

    def submit(self, request: Request) -> int:
        """Queue a request; its handle (for ``cancel``). Raises Busy when full or stopping."""
        with self._cv:
            if self._stopping:
                raise Busy("the server is shutting down", self.config.retry_after, shutting_down=True)
            if len(self._queue) >= self.config.max_queue:
                raise Busy(f"{len(self._queue)} requests are waiting (the most this server queues): "
                           "try again shortly", self.config.retry_after)
            request.handle = next(self._handles)
            self._queue.append(request)
            self._cv.notify()
        return request.handle

    def cancel(self, handle: int) -> None:
        """The request leaves: from the queue now, from the batch at the next step boundary."""
        with self._cv:
            self._cancel.add(handle)
            self._cv.notify()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between two steps (the drafters' state lives there)."""
        with self._cv:
            self._calls.append(fn)
            self._cv.notify()

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        # the caller's context (a specdec.config.use block's runtime) goes with the thread
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="specdec-engine", daemon=True)
        self._thread.start()

    def stop(self, deadline: float = 10.0) -> None:
        """Stop accepting; live requests finish within ``deadline`` seconds, then are cancelled, as are
        the waiting ones at once; returns when the thread has ended."""
        with self._cv:
            self._stopping = True
            self._deadline = time.monotonic() + deadline
            self._cancel.update(r.handle for r in self._queue)
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the engine thread

    def _run(self) -> None:
        try:
            with self.decoder.running():
                while self._turn():
                    pass
        except Exception:  # noqa: BLE001 -- the runtime itself failed: refuse from now on, end every request
            log.exception("the decode loop stopped")
            with self._cv:
                self._stopping = True
                waiting, self._queue = list(self._queue), deque()
            self._fail_all("the decode loop stopped", waiting)
        for fn in self._calls:  # a last save requested while stopping
            fn()

    def _turn(self) -> bool:
        """One pass: cancellations, admissions, one step. False once stopped and drained."""
        session = self.session
        with self._cv:
            while not (self._stopping or self._queue or self._cancel or self._calls or session.rows):
                self._cv.wait()
            if self._stopping and time.monotonic() > self._deadline:
                self._cancel.update(r.handle for r in self._live.values())
            cancel, self._cancel = self._cancel, set()
            calls, self._calls = self._calls, []
            self._drop_queued(cancel)
            admit = self._admissible()
            done = self._stopping and not session.rows and not admit and not self._queue
        for fn in calls:
            fn()
        self._drop_live(cancel)
        try:
            if admit:
                self._admit(admit)
            if session.rows:
                events = session.step()
                self.counters.steps += 1
                self._dispatch(events, self._count_drafts(events[0].stats))
        except Exception as e:  # noqa: BLE001 -- a failed step fails its requests, not the server
            log.exception("decode step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
        self.counters.batch_size = len(self.session.rows)  # (a fresh session after a failure)
        return not done or bool(self.session.rows)

    def _admissible(self) -> list[Request]:
        """Waiting requests that fit the batch now (call under the lock)."""
        session = self.session
        if session.rows and not session.joins:
            return []
        room = self.config.max_batch - len(session.rows)
        return [self._queue.popleft() for _ in range(min(room, len(self._queue)))]

    def _drop_queued(self, cancel: set[int]) -> None:
        kept = deque()
        for r in self._queue:
            if r.handle in cancel:
                r.emit(Update([], "cancelled"))
                self._count_finish("cancelled")
            else:
                kept.append(r)
        self._queue = kept

    def _drop_live(self, cancel: set[int]) -> None:
        gone = [s for s, r in self._live.items() if r.handle in cancel]
        if gone:
            self.session.remove(gone)
            for s in gone:
                self._end(s, Update([], "cancelled"))

    def _admit(self, requests: list[Request]) -> None:
        self.counters.joins += bool(self.session.rows)
        try:  # (popped from the queue: an error here must still reach them)
            prompts = [torch.tensor(r.prompt, dtype=torch.long) for r in requests]
            judge = RowAcceptance([RowRule.make(r.sampling, r.seed) for r in requests])
            ids, events = self.session.add(prompts, [r.max_new for r in requests], judge,
                                           [r.processing for r in requests])
        except Exception as e:  # their prefill failed: they end with the error, and so does the batch
            for r in requests:
                r.emit(Update([], "error", error=f"{type(e).__name__}: {e}"))
                self._count_finish("error")
            raise
        self._live.update(zip(ids, requests))
        self._dispatch(events, cached={s: self.session.cached_tokens(s) for s in ids})

    def _dispatch(self, events: list[StepEvent], source: str | None = None, cached: dict[int, int] | None = None) -> None:
        """``cached``: prompt tokens each sequence took from the prefix cache (its first update says it)."""
        c = self.counters
        now = time.perf_counter()
        new = 0
        for e in events:
            new += len(e.tokens)
            c.sequence_steps += 1
            finish = e.finish
            req = self._live[e.sequence]
            req.answer.extend(e.tokens)
            drafted = e.stats.num_drafted[e.stats.sequences.index(e.sequence)]  # the step's entry of this row
            update = Update(e.tokens, finish, e.from_draft, drafted=drafted, source=source if drafted else None,
                            logprobs=e.logprobs, cached=(cached or {}).get(e.sequence, 0))
            if finish is None:
                req.emit(update)
            else:
                self._end(e.sequence, update)
        c.tokens += new
        c.recent.append((now, new))
        c.prune(now)  # (bounded whether or not anyone scrapes)

    def _count_drafts(self, stats) -> str | None:
        """Counts the step's drafts under their drafter; its name (None: nothing was drafted)."""
        # (not stats.key is None: a drafter of one class, a model's or EAGLE's, drafts with key None)
        if not any(stats.num_drafted):
            return None
        c = self.counters
        source = self.decoder.chooser.source_of(stats.key)
        c.drafted[source] = c.drafted.get(source, 0) + sum(stats.num_drafted)
        c.accepted[source] = c.accepted.get(source, 0) + sum(stats.num_accepted)
        return source

    def _end(self, s: int, update: Update) -> None:
        req = self._live.pop(s)
        self.session.forget(s)
        req.emit(update)
        self._count_finish(update.finish)
        if update.finish in ("stop", "length") and self.on_finished is not None:
            self.on_finished(req.prompt, req.answer)

    def _count_finish(self, reason: str) -> None:
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    def _fail_all(self, message: str, waiting: list[Request] = ()) -> None:
        """A step raised: every live request (and ``waiting``) ends with the error; a fresh session carries on."""
        for req in list(self._live.values()) + list(waiting):
            req.emit(Update([], "error", error=message))
            self._count_finish("error")
        self._live.clear()
        self.session = DecodeSession(self.decoder, self.eos, record_steps=False)
