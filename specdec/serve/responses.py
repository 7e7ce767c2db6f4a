"""OpenAI's response shapes: ids, usage, logprobs, whole answers and stream chunks, and ``TextStream``,
which turns the tokens of an answer into text deltas: whole characters only, held back while they could
still be the start of a stop string, and cut at the first stop string. Pure functions, tested without a
server (the requests' side: ``serve.protocol``).
"""

from __future__ import annotations

import time
import uuid

from specdec.serve.protocol import Generation


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, specdec: dict | None = None, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``specdec``: this server's extension (drafted and accepted tokens, time to
    first token), a field OpenAI's clients keep as an extra and otherwise ignore. ``cached_tokens``: prompt
    tokens taken from the prefix cache (OpenAI's ``prompt_tokens_details.cached_tokens``)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if specdec is not None:
        out["specdec"] = specdec
    return out


def logprobs_object(g: Generation, entries: list[tuple[str, list[int], float, list]] | None, offset: int = 0):
    """OpenAI's logprobs of a choice from (token text, its bytes, logprob, [(text, bytes, logprob)] top):
    chat's ``{"content": [...]}``, completions' parallel lists; None when not asked."""
    if entries is None:
        return None
    if g.chat:
        return {"content": [{"token": t, "bytes": b, "logprob": lp,
                             "top_logprobs": [{"token": tt, "bytes": tb, "logprob": tl} for tt, tb, tl in top]}
                            for t, b, lp, top in entries], "refusal": None}
    offsets, at = [], offset
    for t, _, _, _ in entries:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _, _, _ in entries], "token_logprobs": [lp for _, _, lp, _ in entries],
            "top_logprobs": [_by_text(top) for _, _, _, top in entries], "text_offset": offsets}


def _by_text(top: list) -> dict:
    """Completions' top logprobs keyed by token text: of two tokens with one text (the bytes of one
    character each decode to U+FFFD), the more likely one's, which comes first."""
    out = {}
    for text, _, lp in top:
        out.setdefault(text, lp)
    return out


def completion(g: Generation, rid: str, model: str, text: str, finish: str, use: dict, logprobs=None) -> dict:
    """The whole answer, non-streaming; ``logprobs``: ``logprobs_object``'s entries."""
    lp = logprobs_object(g, logprobs)
    if g.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if g.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk(g: Generation, rid: str, model: str, text: str | None, finish: str | None = None,
          use: dict | None = None, first: bool = False, logprobs=None, offset: int = 0) -> dict:
    """One streamed chunk: a text delta (``text`` None: the usage chunk, no choices), with the logprobs
    of the tokens it completes (``logprobs_object``'s entries) when asked."""
    lp = logprobs_object(g, logprobs, offset)
    if text is None:
        choices = []
    elif g.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk" if g.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


class TextStream:
    """The answer's text so far, released in safe pieces.

    ``feed(tokens)`` returns the new text that is final: decoded from all tokens so far (so a
    character split over tokens comes out whole: a trailing U+FFFD is held back), minus a tail that
    could still begin a stop string. On a stop string the text is cut before it and ``stopped`` is set.
    Example, stop ["END"]: tokens decode to "abcE" -> "abc" released, "E" held; then "abcEND!" -> stopped,
    nothing more released (text "abc").
    """

    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self.decode, self.stop = decode, stop
        self.tokens: list[int] = []
        self.sent = 0  # characters released
        self.text = ""  # released text
        self.stopped = False

    def feed(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.tokens += tokens
        full = self.decode(self.tokens)
        cut = min((i for i in (full.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped, full = True, full[:cut]
        elif not final:
            if full.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
                full = full.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            full = full[: len(full) - hold]
        new = full[self.sent:] if len(full) > self.sent else ""
        self.sent += len(new)
        self.text += new
        return new

    def tokens_within(self) -> int:
        """How many of the tokens so far the released text holds whole: the fewest whose text covers it
        (all of them until a stop string or a held-back tail cuts some off)."""
        n = len(self.tokens)
        while n > 0 and len(self.decode(self.tokens[: n - 1])) >= len(self.text):
            n -= 1
        return n
