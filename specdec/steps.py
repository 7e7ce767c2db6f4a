"""What a decode session's steps yield, and its table of live sequences.

``StepStats`` (one step's counts and seconds), ``StepEvent`` (what a step appended to one sequence, for
streaming UIs), ``SequenceResult`` (what one sequence generated), ``Batch`` (which sequence each live row
is and what each has generated, truncated at its max_new and EOS), and ``StepOutcome`` with
``learn_step``: what the controller learns from a verified step (the session's step 5, and the replays').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Hashable

from specdec.controller import DraftLengthController
from specdec.drafters.base import Commit
from specdec.drafters.chooser import Shadow
from specdec.processing import RowProcessor, TokenLogprob
from specdec.tree import DraftTree, path_along


@dataclass(frozen=True)
class StepStats:
    num_drafted: list[int]  # per live sequence: real draft nodes verified this step
    num_accepted: list[int]  # per live sequence: drafted tokens kept (the step yields this + 1)
    draft_time: float  # seconds in drafter.propose
    verify_time: float  # seconds in the target forward, verification and commit
    sequences: list[int] = field(default_factory=lambda: [0])  # which sequence each entry is
    split: bool = False  # the step's attention ran per sequence (SPLIT) rather than padded (PAD)
    key: object = None  # the draft class verified this step (None: nothing drafted)


@dataclass(frozen=True)
class StepEvent:
    """What one step appended to one sequence, for streaming UIs."""

    tokens: list[int]  # the new tokens, after max_new_tokens / EOS truncation
    from_draft: int  # how many of the leading tokens were accepted drafts (the rest: the target's)
    stats: StepStats
    sequence: int = 0  # the sequence's id (``generate``: its index in the batch given)
    finished: bool = False  # the sequence stopped this step (EOS or max_new) and left the batch
    finish: str | None = None  # why it stopped: "stop" (its EOS) or "length" (max_new); None while it goes on
    # one per token when the sequence asked for them (``Processing.logprobs``), else None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class SequenceResult:
    """What one sequence of a session generated (``DecodeSession.result``)."""

    tokens: list[int]  # its new tokens, EOS included where it stopped on one
    steps: int  # target forwards that gave it tokens (its prefill's included)
    accepted: int  # drafted tokens it kept



class Batch:
    """The live sequences: which sequence each live row is, and what each has generated so far
    (keyed by sequence id: a session's sequences come and go)."""

    def __init__(self, eos: set[int]) -> None:
        self.rows: list[int] = []  # live row -> sequence id
        self.prompt: dict[int, list[int]] = {}
        self.new: dict[int, list[int]] = {}
        self.max_new: dict[int, int] = {}
        self.steps: dict[int, int] = {}  # target forwards per sequence
        self.accepted: dict[int, int] = {}  # drafted tokens kept per sequence
        self.processors: dict[int, RowProcessor] = {}  # the sequences that process their logits
        self.cached: dict[int, int] = {}  # prompt tokens each sequence took from the prefix cache
        self.eos = eos

    def add(self, s: int, prompt: list[int], max_new: int, processor: RowProcessor | None = None) -> None:
        self.prompt[s], self.new[s], self.max_new[s] = prompt, [], max_new
        self.steps[s] = self.accepted[s] = 0
        if processor is not None:
            self.processors[s] = processor

    def forget(self, s: int) -> None:
        for d in (self.prompt, self.new, self.max_new, self.steps, self.accepted, self.processors, self.cached):
            d.pop(s, None)

    def live_processors(self) -> list[RowProcessor | None]:
        """Each live row's processor (None: its logits go to the verifier as they are)."""
        return [self.processors.get(s) for s in self.rows]

    def wanted(self) -> int:
        """Draft tokens still useful to some live sequence (after its bonus token)."""
        return max(self.max_new[s] - len(self.new[s]) - 1 for s in self.rows)

    def extend(self, seqs: list[int], commit: Commit, stats: StepStats,
               logprobs: list[list[TokenLogprob] | None] | None = None) -> tuple[list[StepEvent], list[int]]:
        """Append each sequence's new tokens (commit row i is sequence ``seqs[i]``; truncated at its
        max_new and EOS), with their logprobs where asked: one event per sequence, and the rows that go on."""
        events, keep = [], []
        for row, s in enumerate(seqs):
            toks = commit.new_tokens(row)[: self.max_new[s] - len(self.new[s])]
            stop = next((i for i, t in enumerate(toks) if t in self.eos), None)
            if stop is not None:
                toks = toks[: stop + 1]
            lps = logprobs[row][: len(toks)] if logprobs is not None and logprobs[row] is not None else None
            if s in self.processors:
                self.processors[s].advance(toks)
            self.new[s].extend(toks)
            self.steps[s] += 1
            drafted = min(len(toks), int(commit.num_accepted[row]))
            self.accepted[s] += drafted
            goes_on = stop is None and len(self.new[s]) < self.max_new[s]
            finish = None if goes_on else ("stop" if stop is not None else "length")
            events.append(StepEvent(toks, drafted, stats, s, finished=not goes_on, finish=finish, logprobs=lps))
            if goes_on:
                keep.append(row)
        return events, keep

    def text(self, s: int) -> list[int]:
        """Sequence s's committed tokens: its prompt, then what it generated."""
        return self.prompt[s] + self.new[s]


@dataclass(frozen=True)
class StepOutcome:
    """What a verified step tells the controller (the decoder's step 5, and the replays')."""

    key: Hashable  # the class of its draft
    tree: DraftTree  # what was drafted
    accepted: list[list[int]]  # per row the verified tree's accepted path (node indices, -1 padded)
    verify_time: float | None  # the step's seconds (None: a replay without a cost curve)
    draft_time: float | None
    shadows: Sequence[Shadow] = ()  # drafts made beside it and not verified, scored against ``texts``
    texts: Sequence[list[int]] = ()  # the tokens each row committed
    # whether it grew the target's store, and the drafter's catch-up seconds (``DraftLengthController.update``)
    grew: bool = False
    resume: float = 0.0
    catch_up: float = 0.0


def learn_step(controller: DraftLengthController, step: StepOutcome) -> None:
    """What the controller learns from a verified step: the drafted and accepted counts with the step's
    seconds, the accepted path per row, and each shadow draft scored against the committed tokens."""
    drafted = step.tree.num_nodes.tolist()
    controller.update(drafted, [sum(a >= 0 for a in acc) for acc in step.accepted], step.verify_time,
                      step.draft_time, step.key, grew=step.grew, resume=step.resume, catch_up=step.catch_up)
    if any(drafted):
        controller.observe_tree(step.tree.real_nodes()[0], step.accepted, step.key)
    for sh in step.shadows:
        paths = [path_along(p, t, x) for p, t, x in zip(sh.parents, sh.tokens, step.texts)]
        controller.observe_shadow(sh.parents, paths, [len(x) for x in step.texts], sh.seconds, sh.key)
