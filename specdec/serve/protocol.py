"""OpenAI's request and response shapes: pure functions, so every rule is tested without a server.

``parse_request`` checks a request body (chat or completions) and returns a ``Generation``, or raises
``ApiError`` with the status, message, type, param and code OpenAI's clients expect:
``{"error": {"message": ..., "type": "invalid_request_error", "param": "temperature", "code": null}}``.
``parse_json`` reads a body's bytes (UTF-8 JSON, any nesting a 400 rather than a crash). The answers'
shapes are ``serve.responses``'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.processing.grammar import Constraint
from specdec.processing.rows import MAX_TOP_LOGPROBS
from specdec.sampling import SamplingParams

MAX_STOP = 4  # stop strings per request, as OpenAI allows
ROLES = ("system", "user", "assistant", "tool", "developer")
UNSUPPORTED = ("echo", "best_of", "tools", "suffix", "tool_choice", "functions", "function_call",
               "min_p", "typical_p", "n_probs")  # refused by name when set, never ignored
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI allows
SEEDS = (-(2**63), 2**64 - 1)  # what a torch.Generator takes (a larger seed would fail the batch it joins)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """A checked request."""

    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    messages: list | None  # chat: [{"role", "content": str}]
    prompt: str | None  # completions
    max_tokens: int | None  # None: as many as the default and the context allow
    sampling: SamplingParams | None  # None: greedy (temperature 0)
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    options: "Options" = None  # penalties, biases, a constraint, logprobs (``Options()``: none)

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", Options())


@dataclass(frozen=True)
class Options:
    """What a request asks of the target's scores and reports, checked (compiled by the service)."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # an extension (vLLM and llama.cpp take it): HF's rule
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    constraint: Constraint | None = None  # response_format json_object / json_schema, or regex / grammar
    logprobs: int | None = None  # None: no logprobs; k: each token's and its k most likely alternatives


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes):
    """A request body: UTF-8 JSON (RFC 8259), or ApiError 400 naming what is wrong. Nesting deeper than
    the parser's recursion limit is refused, not a crash; NaN and Infinity (Python's extension) too."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} "
                            "(JSON bodies must be UTF-8)") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None


def _text(s: str, where: str, param: str) -> str:
    """``s`` if it can be encoded (a JSON escape can make a lone surrogate, which no tokenizer takes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{where} holds a lone surrogate (\\u{ord(s[e.start]):04x} at {e.start}): not text",
                       param) from None
    return s


def _number(body: dict, name: str, lo: float, hi: float, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {type(v).__name__}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _integer(body: dict, name: str, lo: int, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {type(v).__name__}", name)
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {v}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _message(message, i: int) -> dict:
    """One chat message, checked: {"role", "content": str}."""
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}",
                       "messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string, got {type(content).__name__}", "messages")
    return {"role": role, "content": _text(content, f"messages[{i}].content", "messages")}


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    return tuple(_text(s, "stop", "stop") for s in stops)


def parse_request(body, chat: bool, models: tuple[str, ...]) -> Generation:
    """Check a request body for /v1/chat/completions (``chat``) or /v1/completions; ``models``: the
    names this server answers to."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {type(model).__name__}", "model")
    if model is not None and model not in models:  # (repr: a lone surrogate in it would not encode)
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {', '.join(models)}",
                       "model", "model_not_found")
    for name in UNSUPPORTED:  # asked for (truthy; best_of above 1): refused rather than ignored
        v = body.get(name)
        if v and not (name == "best_of" and v == 1):
            raise ApiError(400, f"'{name}' is not supported by this server", name)
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", "n")
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "'messages' is required", "messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        messages = [_message(m, i) for i, m in enumerate(messages)]
        prompt = None
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "'prompt' is required", "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt per request)", "prompt")
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        prompt, messages = _text(prompt, "prompt", "prompt"), None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, 1, None)
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)  # OpenAI's range and default
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be > 0", "top_p")
    top_k = _integer(body, "top_k", 0, 0)  # an extension (llama.cpp and vLLM take it too); 0 = off
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {type(seed).__name__}", "seed")
    if seed is not None and not SEEDS[0] <= seed <= SEEDS[1]:
        raise ApiError(400, f"'seed' must be between -2**63 and 2**64 - 1, got {seed}", "seed")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = _flag(options, "include_usage")
    sampling = None if temperature == 0 else SamplingParams(float(temperature), int(top_k), float(top_p))
    return Generation(chat, messages, prompt, max_tokens, sampling, seed, _stop(body), _flag(body, "stream"),
                      include_usage, _options(body, chat))


def _options(body: dict, chat: bool) -> Options:
    bias = body.get("logit_bias")
    pairs = []
    if bias is not None:
        if not isinstance(bias, dict):
            raise ApiError(400, "'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
        for k, v in bias.items():
            if not (isinstance(k, str) and k.isdigit()):
                raise ApiError(400, f"'logit_bias' keys are token ids (digits), got {k!r}", "logit_bias")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise ApiError(400, f"'logit_bias' values are numbers in [-100, 100], got {v!r} for {k}", "logit_bias")
            pairs.append((int(k), float(v)))
    repetition = _number(body, "repetition_penalty", 0.0, 10.0, 1.0)
    if repetition == 0:
        raise ApiError(400, "'repetition_penalty' must be > 0", "repetition_penalty")
    return Options(float(_number(body, "frequency_penalty", -2.0, 2.0, 0.0)),
                   float(_number(body, "presence_penalty", -2.0, 2.0, 0.0)), float(repetition), tuple(pairs),
                   _constraint(body), _logprobs(body, chat))


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: ``logprobs`` true, ``top_logprobs`` 0-20 alternatives; completions: ``logprobs`` 0-5."""
    if chat:
        top = _integer(body, "top_logprobs", 0, None)
        if top is not None and top > MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        if not _flag(body, "logprobs"):
            if top is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return top or 0
    k = body.get("logprobs")
    if k is None or k is False:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {k!r}", "logprobs")
    return k


def _constraint(body: dict) -> Constraint | None:
    """``response_format`` (OpenAI's: text, json_object, json_schema), or the extensions ``regex`` and
    ``grammar`` (GBNF, as llama.cpp's server takes it): at most one of them."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ApiError(400, "'response_format' must be an object with a 'type'", "response_format")
        kind = fmt["type"]
        if kind == "json_object":
            found.append(("response_format", Constraint.json_object()))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError(400, "'response_format' json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                               "response_format")
            found.append(("response_format", Constraint.json_schema(spec["schema"])))
        elif kind != "text":
            raise ApiError(400, f"'response_format' type {kind!r} is not supported (text, json_object, json_schema)",
                           "response_format")
    for name, make in (("regex", Constraint.regex), ("grammar", Constraint.gbnf)):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise ApiError(400, f"'{name}' must be a non-empty string", name)
            found.append((name, make(v)))
    if len(found) > 1:
        raise ApiError(400, f"one constraint per request: got {', '.join(n for n, _ in found)}", found[1][0])
    return found[0][1] if found else None
