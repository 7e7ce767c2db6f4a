"""Who wrote each character of a streamed answer: a drafted token the target kept, or the target's own.

A step appends ``from_draft`` accepted draft tokens, then (unless the answer ended) the target's own
token. ``Provenance`` keeps, over the answer's decoded text, the spans each step wrote, and
``pieces(start, text)`` splits a released piece of the text along them, for the stream's ``specdec``
extension (what the chat page tints). Example, byte-level tokens:

    step 1 (prefill): "H"                      -> "H" target, step 1
    step 2: drafts "el" kept, then "l"         -> "el" draft, "l" target, step 2
    pieces(0, "Hell") -> [{"text": "H", "draft": False, "step": 1, ...}, {"text": "el", "draft": True,
                          "step": 2, ...}, {"text": "l", "draft": False, "step": 2, ...}]

Characters count in the decoded text of the answer so far. A character split over tokens (a UTF-8
sequence over byte tokens) decodes as U+FFFD until its last token comes, and may then shrink (two
U+FFFD become one "é"): the spans never shrink, so it stays with the step of its first byte. That, and
a decoder whose text of a prefix is not a prefix of the whole text (a tokenizer that cleans spaces),
only blur a boundary by a character or so; the text itself is always ``TextStream``'s.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Step:
    """One decode step's share of one answer."""

    index: int  # 1-based: the answer's first token came from step 1 (its prefill)
    drafter: str | None  # whose draft the step verified (None: nothing drafted)
    drafted: int  # draft tokens verified for this answer in the step
    accepted: int  # of them, kept


@dataclass(frozen=True)
class _Span:
    end: int  # the span covers characters [previous span's end, end) of the decoded text
    draft: bool  # accepted draft tokens (else the target's own)
    step: Step


class Provenance:
    """The spans of an answer's text by who wrote them (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.spans: list[_Span] = []
        self.ends: list[int] = []  # [span.end for span in spans], for bisect
        self.steps = 0

    def add(self, tokens: list[int], from_draft: int, drafter: str | None = None, drafted: int = 0) -> None:
        """A step's tokens for this answer, the leading ``from_draft`` of them kept from a draft."""
        if not tokens:
            return
        self.steps += 1
        step = Step(self.steps, drafter, drafted, from_draft)
        before = self.ends[-1] if self.ends else 0
        if 0 < from_draft < len(tokens):
            split = len(self.decode(self.tokens + tokens[:from_draft]))
        else:
            split = None
        self.tokens += tokens
        end = max(before, len(self.decode(self.tokens)))
        if from_draft == len(tokens):  # all kept from the draft (the target's token cut by EOS / length)
            split = end
        split = before if split is None else min(max(split, before), end)
        for a, b, draft in ((before, split, True), (split, end, False)):
            if b > a:
                self.spans.append(_Span(b, draft, step))
                self.ends.append(b)

    def pieces(self, start: int, text: str) -> list[dict]:
        """``text``, characters [start, start + len(text)) of the answer, split by who wrote them;
        characters past the last span (only where a decoder's text grew back) go to the last step, as
        the target's."""
        out, at, end = [], start, start + len(text)
        i = bisect.bisect_right(self.ends, start)
        while at < end:
            if i < len(self.spans):
                span, stop = self.spans[i], min(end, self.ends[i])
            else:
                span, stop = _Span(end, False, self.spans[-1].step if self.spans else Step(0, None, 0, 0)), end
            s = span.step
            out.append({"text": text[at - start:stop - start], "draft": span.draft, "step": s.index,
                        "drafter": s.drafter, "drafted": s.drafted, "accepted": s.accepted})
            at, i = stop, i + 1
        return out
