"""The HTTP front end: Starlette routes on uvicorn's event loop, the decode loop on its own thread.

    service = Service(decoder, tokenizer, ServeConfig(model_name="default"), cache)
    app = create_app(service)            # an ASGI app: uvicorn.run(app, host=..., port=...)

Each request is checked for its API key (``ServeConfig.api_key``: every route but /health and the chat
page's files), read up to ``max_body_bytes``, parsed and checked (``protocol``), tokenized on a worker
thread (a long prompt or chat template never holds up the event loop), and queued to the ``Engine``;
the engine's updates cross to the event loop through an ``asyncio.Queue`` per request. Streaming answers are server-sent
events in OpenAI's chunk format ending with ``data: [DONE]``. A client that goes away (a closed
stream, or a dropped connection while waiting for a whole answer), or a request past its time limit
(``request_timeout``), has its row cancelled; the batch frees it at the next step. ``/`` is a chat page
(``static/``) over the same API, its chunks' ``specdec`` extension saying who wrote each piece
(``provenance``), its live panel from ``/stats`` (``live``). Why Starlette and uvicorn, and the page:
docs/decisions/016-server.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from specdec.processing import ConstraintError, Processing, Vocabulary
from specdec.prompting import chat_ids, context_window, eos_ids, has_chat_template
from specdec.runtime.memory import malloc_trim
from specdec.serve import protocol
from specdec.serve.cache import ServedCache
from specdec.serve.engine import Busy, Engine, EngineConfig, Request, Update
from specdec.serve.live import SAMPLE_EVERY, History, Sample, snapshot
from specdec.serve.protocol import ApiError, Generation, TextStream
from specdec.serve.provenance import Provenance

try:
    from jinja2 import TemplateError  # what a chat template raises on messages it refuses
except ModuleNotFoundError:  # no chat templates without jinja2 either
    TemplateError = ()

log = logging.getLogger("specdec.serve")
# answered without the API key: a load balancer's probe, and the chat page (it holds no data; it asks
# for the key, then sends it with every request it makes)
OPEN_PATHS = ("/health", "/")
STATIC = Path(__file__).parent / "static"  # the chat page's files, served under /static/
# the page loads nothing from another host, and runs no inline script (what an injected one would need)
PAGE_POLICY = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
               "frame-ancestors 'none'")
# a prompt of more characters than window x (longest token's text + 1) x this is refused untokenized:
# it cannot fit even if a normalizer merged characters (NFKC composes at most 3 into 1)
CHARS_MARGIN = 4


@dataclass(frozen=True)
class ServeConfig:
    model_name: str = "default"  # the id /v1/models lists and requests name (``model``)
    default_max_tokens: int = 512  # a request naming no max_tokens gets this, clipped to the context
    engine: EngineConfig = field(default_factory=EngineConfig)
    shutdown_deadline: float = 10.0  # seconds in-flight answers get to finish on shutdown, then cancelled
    # seconds between handing the C allocator's free pages back to the system (glibc's malloc_trim; 0:
    # never, the default: under steady load the pages are faulted back in at the next joins and the
    # throughput fell ~20%; docs/decisions/016-server.md, the soak)
    trim_every: float = 0.0
    # None: no key; else every route but /health wants "Authorization: Bearer <key>" (401 without it);
    # kept out of repr: a logged config must not show it
    api_key: str | None = field(default=None, repr=False)
    # a larger request body is refused (413) from its Content-Length before it is read, or, chunked, as
    # soon as it passes this; 8 MiB: ~2M tokens of text, beyond any context window this server runs
    max_body_bytes: int = 8 * 2**20
    # seconds from a request's arrival to its last token (0: no limit); then its row is cancelled and
    # it is answered 504 (or, streaming, ends with an error event); a body still arriving then: 408
    request_timeout: float = 0.0

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        if self.max_body_bytes < 1 or self.request_timeout < 0:
            raise ValueError(f"need max_body_bytes >= 1 and request_timeout >= 0, got {self.max_body_bytes}, "
                             f"{self.request_timeout}")


class Service:
    """What the routes share: the engine, the tokenizer, the cache and the metrics."""

    def __init__(self, decoder, tokenizer, config: ServeConfig = ServeConfig(),
                 cache: ServedCache | None = None) -> None:
        self.tokenizer, self.config, self.cache = tokenizer, config, cache
        # positions a request may reach: the context window, or a sliding window the store does not implement
        windows = [w for w in (context_window(decoder.target), decoder.sliding_window) if w is not None]
        self.window = min(windows) if windows else None
        per_token = chars_per_token(tokenizer)
        # longer prompts cannot fit the window: refused before they are tokenized
        self.max_prompt_chars = self.window * per_token * CHARS_MARGIN if self.window and per_token else None
        on_finished = cache.remember if cache is not None and cache.active else None
        self.eos = set(eos_ids(decoder.target, tokenizer))
        self.engine = Engine(decoder, self.eos, config.engine, on_finished)
        self.vocab_size = decoder.vocab_size
        self._vocabulary: Vocabulary | None = None  # the tokenizer as the grammar engine reads it (built on first use)
        self._vocabulary_lock = threading.Lock()
        self.models = (config.model_name,)
        self.registry = CollectorRegistry()
        self.http = Counter("specdec_http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(self.engine))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (Linux): the soak reads it
        self.history = History()  # the chat page's charts (GET /stats)
        self.started = time.time()

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def encode(self, g: Generation) -> list[int]:
        """The prompt's ids, checked against the context window; ApiError otherwise. Tokenizing and the
        chat template take a long prompt a while: the routes call this on a worker thread."""
        chars = sum(len(m["content"]) for m in g.messages) if g.chat else len(g.prompt)
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters, more than this model's context window of "
                                f"{self.window} tokens can hold (at most {self.max_prompt_chars} characters)",
                           "messages" if g.chat else "prompt", "context_length_exceeded")
        if g.chat:
            if not any(m["content"].strip() for m in g.messages):
                raise ApiError(400, "the messages hold no text (empty prompt)", "messages")
            if has_chat_template(self.tokenizer):
                try:
                    ids = chat_ids(self.tokenizer, g.messages)[0].tolist()
                except TemplateError as e:  # the template's own rules (roles must alternate, ...)
                    raise ApiError(400, f"this model's chat template refuses the messages: {e}", "messages") from None
            else:
                ids = self.tokenizer("\n".join(m["content"] for m in g.messages))["input_ids"]
        else:
            ids = self.tokenizer(g.prompt)["input_ids"]
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens (empty prompt)", "messages" if g.chat else "prompt")
        if self.window is not None and len(ids) >= self.window:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context window is {self.window} "
                                "tokens (no room left to answer)", "messages" if g.chat else "prompt",
                           "context_length_exceeded")
        return ids

    def vocabulary(self) -> Vocabulary:
        """Built once, on the first request that needs it (~0.4 s for 49k tokens), on a worker thread."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary.of(self.tokenizer, self.vocab_size, self.eos)
            return self._vocabulary

    def processing(self, g: Generation) -> Processing | None:
        """The request's penalties, biases, compiled constraint and logprobs (None: none); ApiError 400 names
        an option that cannot be honoured. Compiling takes a while: the routes call this on a worker thread."""
        o = g.options
        grammar = None
        if o.constraint is not None:
            param = "response_format" if o.constraint.kind.startswith("json") else (
                "regex" if o.constraint.kind == "regex" else "grammar")
            try:
                grammar = o.constraint.compile(self.vocabulary())
            except ConstraintError as e:
                raise ApiError(400, str(e), param) from None
        opts = Processing(o.repetition_penalty, o.frequency_penalty, o.presence_penalty, dict(o.logit_bias),
                          grammar, o.logprobs)
        try:
            opts.check_vocab(self.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e), "logit_bias") from None
        return opts if opts.changes_scores or opts.logprobs is not None else None

    def logprob_entries(self, logprobs: list) -> list[tuple[str, list[int], float, list]]:
        """``TokenLogprob``s as OpenAI reports them: each token's text and bytes (a byte-level token may hold
        part of a character: its bytes say which), its logprob and its alternatives'."""
        tok = self.vocabulary().tokenizer

        def piece(t: int) -> tuple[str, list[int]]:
            raw = bytes(tok.decode_bytes([t]))
            return raw.decode("utf-8", errors="replace"), list(raw)

        return [(*piece(x.token), _finite(x.logprob), [(*piece(t), _finite(lp)) for t, lp in x.top]) for x in logprobs]

    def max_new(self, g: Generation, prompt_tokens: int) -> int:
        room = self.window - prompt_tokens if self.window is not None else None
        if g.max_tokens is None:
            return self.config.default_max_tokens if room is None else min(self.config.default_max_tokens, room)
        if room is not None and g.max_tokens > room:
            raise ApiError(400, f"max_tokens {g.max_tokens} + the prompt's {prompt_tokens} tokens pass this model's "
                                f"context window of {self.window} tokens (at most {room} here)", "max_tokens",
                           "context_length_exceeded")
        return g.max_tokens

    def submit(self, g: Generation, ids: list[int], max_new: int,
               processing: Processing | None = None) -> tuple[int, asyncio.Queue]:
        """Queue the generation; its handle and the queue its updates arrive on (Busy: 429 / 503)."""
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()

        def emit(u: Update) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(updates.put_nowait, u)

        try:
            handle = self.engine.submit(Request(ids, max_new, g.sampling, g.seed, emit, processing))
        except Busy as e:
            raise ApiError(503 if e.shutting_down else 429, str(e), None, "server_busy",
                           "server_error" if e.shutting_down else "rate_limit_error",
                           {"Retry-After": str(e.retry_after)}) from None
        return handle, updates


def _finite(x: float) -> float:
    """A logprob JSON can carry: -inf (a token the processing ruled out) as OpenAI's floor, -9999.0."""
    return max(float(x), -9999.0)


def chars_per_token(tokenizer) -> int | None:
    """The most characters one token can stand for in a text: its vocabulary's longest token (a byte-level
    token's text has a character per byte; a byte-fallback token's, six), + 1 for a space a decoder may
    put between two tokens. None when the vocabulary cannot be listed."""
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return max(len(t) for t in tokens if t is not None) + 1
    except Exception:  # noqa: BLE001 -- a tokenizer without a listable vocabulary: no bound, tokenize to check
        return None


class KeyCheck:
    """``Authorization: Bearer <key>`` on every route but ``OPEN_PATHS``, else 401 in OpenAI's error shape.
    The key is compared by its SHA-256 in constant time (``hmac.compare_digest``): neither its bytes nor
    its length show in the timing. Used by this app's middleware and by the Ray router (``replicas``)."""

    def __init__(self, key: str) -> None:
        self.digest = hashlib.sha256(key.encode()).digest()

    def refusal(self, scope) -> ApiError | None:
        """The 401 for this HTTP request's scope, or None when it may pass."""
        if scope["path"] in OPEN_PATHS or scope["path"].startswith("/static/"):
            return None
        given = Headers(scope=scope).get("authorization")
        scheme, _, token = (given or "").partition(" ")
        # header values arrive as latin-1 text: back to the bytes the client sent
        digest = hashlib.sha256(token.strip().encode("latin-1", "replace")).digest()
        if hmac.compare_digest(digest, self.digest) and scheme.lower() == "bearer":
            return None
        message = ("no API key given: send the header 'Authorization: Bearer <key>'" if given is None
                   else "the API key is not valid")
        return ApiError(401, message, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class _RequireKey:
    """Pure ASGI middleware: ``KeyCheck`` before the body is read."""

    def __init__(self, app, key: str, counter: Counter) -> None:
        self.app, self.check, self.counter = app, KeyCheck(key), counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (error := self.check.refusal(scope)) is not None:
            self.counter.labels("unauthorized", "401").inc()
            await _error(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass
class _Progress:
    """A request's updates so far: what its usage reports."""

    arrived: float  # time.perf_counter() when the request came in
    tokens: int = 0  # generated (before a stop string cut them)
    drafted: int = 0  # draft tokens verified for it
    accepted: int = 0  # of them, kept
    first_token: float | None = None  # seconds from arrival to its first token
    steps: int = 0  # target forwards that gave it tokens (its prefill's included): tau = tokens / steps
    cached: int = 0  # prompt tokens taken from the prefix cache

    def add(self, u: Update) -> None:
        self.cached += u.cached
        if u.tokens and self.first_token is None:
            self.first_token = time.perf_counter() - self.arrived
        self.steps += bool(u.tokens)
        self.tokens += len(u.tokens)
        self.drafted += u.drafted
        self.accepted += u.from_draft

    def usage(self, prompt_tokens: int) -> dict:
        ttft = None if self.first_token is None else round(self.first_token, 6)
        return protocol.usage(prompt_tokens, self.tokens, {"drafted_tokens": self.drafted,
                                                           "accepted_tokens": self.accepted,
                                                           "time_to_first_token_s": ttft, "steps": self.steps,
                                                           "cached_tokens": self.cached}, self.cached)


class _Deadline:
    """A request's time limit from its arrival (``ServeConfig.request_timeout``; 0: none)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds if seconds > 0 else None

    def left(self) -> float | None:
        """Seconds left (None: no limit)."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def error(self) -> ApiError:
        return ApiError(504, f"the request took longer than this server's limit of {self.seconds:g} s "
                             "(--request-timeout) and was cancelled", None, "request_timeout", "server_error")


class _EngineCollector:
    """The engine's counters as Prometheus metrics, read at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        e, c = self.engine, self.engine.counters
        yield GaugeMetricFamily("specdec_queue_length", "requests waiting for a batch row", value=e.queue_length)
        yield GaugeMetricFamily("specdec_batch_size", "live rows in the decode batch", value=c.batch_size)
        yield CounterMetricFamily("specdec_generated_tokens", "tokens generated", value=c.tokens)
        yield CounterMetricFamily("specdec_steps", "batched target forwards (verify steps)", value=c.steps)
        yield GaugeMetricFamily("specdec_tokens_per_second", "tokens generated per second, last 10 s",
                                value=c.tokens_per_second(time.perf_counter()))
        yield GaugeMetricFamily("specdec_tau", "mean tokens per target forward per sequence (accepted drafts + 1)",
                                value=c.tokens / max(1, c.sequence_steps))
        finished = CounterMetricFamily("specdec_requests", "requests ended, by outcome", labels=["outcome"])
        drafted = CounterMetricFamily("specdec_drafted_tokens", "drafted tokens verified", labels=["drafter"])
        accepted = CounterMetricFamily("specdec_accepted_tokens", "drafted tokens accepted", labels=["drafter"])
        rate = GaugeMetricFamily("specdec_acceptance_rate", "accepted / drafted tokens", labels=["drafter"])
        for reason, n in sorted(c.finished.items()):
            finished.add_metric([reason], n)
        for source, n in sorted(c.drafted.items()):
            drafted.add_metric([source], n)
            accepted.add_metric([source], c.accepted.get(source, 0))
            rate.add_metric([source], c.accepted.get(source, 0) / max(1, n))
        yield from (finished, drafted, accepted, rate)
        prefix = e.decoder.prefix_cache
        if prefix is not None:
            yield from prefix_metrics(prefix)


def prefix_metrics(cache):
    """The prefix cache's counts (``specdec.kv.prefix.PrefixStats``) as Prometheus metrics."""
    st = cache.stats
    yield CounterMetricFamily("specdec_prefix_cache_lookups", "prompts looked up in the prefix cache", value=st.lookups)
    yield CounterMetricFamily("specdec_prefix_cache_hits", "prompts that reused cached rows", value=st.hits)
    yield CounterMetricFamily("specdec_prefix_cache_reused_tokens", "prompt tokens taken from the prefix cache",
                              value=st.tokens_reused)
    yield CounterMetricFamily("specdec_prefix_cache_prefilled_tokens", "prompt tokens computed (the rest)",
                              value=st.tokens_prefilled)
    yield CounterMetricFamily("specdec_prefix_cache_evicted_blocks", "blocks evicted (least recently used)",
                              value=cache.index.evictions)
    yield GaugeMetricFamily("specdec_prefix_cache_bytes", "bytes of K/V rows held", value=cache.nbytes)
    yield GaugeMetricFamily("specdec_prefix_cache_max_bytes", "the budget (--prefix-cache-mb)", value=cache.max_bytes)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size} bytes; this server takes at most {limit} (--max-body-bytes)",
                    None, "request_too_large")


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The body's bytes, at most ``limit``: a larger Content-Length is refused before a byte is read, a
    chunked body as soon as it passes the limit (the rest is never kept: uvicorn discards it)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(length, limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise _too_large(f"over {limit}", limit)
    return bytes(raw)


async def _body(request: HttpRequest, limit: int, deadline: _Deadline):
    """The request's JSON body: read within the deadline (408 otherwise: a client that sends slowly holds
    no more than its time), parsed on a worker thread (a large body takes a while)."""
    try:
        raw = await asyncio.wait_for(read_body(request, limit), deadline.left())
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within this server's limit of {deadline.seconds:g} s "
                            "(--request-timeout)", None, "request_timeout") from None
    return await run_in_threadpool(protocol.parse_json, raw)


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client goes away (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(service: Service, request: HttpRequest, g: Generation, ids: list[int], max_new: int,
                 progress: _Progress, deadline: _Deadline, processing: Processing | None) -> Response:
    handle, updates = service.submit(g, ids, max_new, processing)
    text = TextStream(service.decode, g.stop)
    logprobs = []
    gone = asyncio.ensure_future(_disconnected(request))
    finish = None
    try:
        while finish is None:
            get = asyncio.ensure_future(updates.get())
            await asyncio.wait({get, gone}, timeout=deadline.left(), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the client went away, or the time is up: free its row (finally)
                get.cancel()
                if gone.done():
                    return Response(status_code=499)
                raise deadline.error()
            u = get.result()
            progress.add(u)
            if not text.stopped:
                logprobs += u.logprobs or []
            text.feed(u.tokens, final=u.finish is not None)
            finish = "stop" if text.stopped else u.finish
        if finish == "error":
            raise ApiError(500, f"generation failed: {u.error}", type_="server_error")
    finally:
        gone.cancel()
        if finish is None or text.stopped:
            service.engine.cancel(handle)
    use = progress.usage(len(ids))
    entries = None
    if g.options.logprobs is not None:  # the tokens the answer's text holds (a stop string cuts the rest)
        entries = await run_in_threadpool(service.logprob_entries, logprobs[: text.tokens_within()])
    return JSONResponse(protocol.completion(g, protocol.new_id(g.chat), service.models[0], text.text, finish, use,
                                            entries))


async def _stream(service: Service, g: Generation, ids: list[int], handle: int, updates: asyncio.Queue,
                  progress: _Progress, deadline: _Deadline):
    rid, model = protocol.new_id(g.chat), service.models[0]
    text = TextStream(service.decode, g.stop)
    logprobs, sent_logprobs, offset = [], 0, 0  # every token's so far; how many went out; their text's length
    marks = Provenance(service.decode)  # who wrote each piece: the chunks' "specdec" extension
    finish = None
    try:
        if g.chat:
            yield _sse(protocol.chunk(g, rid, model, "", first=True))
        while finish is None:
            try:
                u = await asyncio.wait_for(updates.get(), deadline.left())
            except asyncio.TimeoutError:  # the status (200) is sent: the stream ends with the error (its row: finally)
                yield _sse(deadline.error().body())
                break
            progress.add(u)
            if not text.stopped:
                logprobs += u.logprobs or []
            delta = text.feed(u.tokens, final=u.finish is not None)
            marks.add(u.tokens, u.from_draft, u.source, u.drafted)
            finish = "stop" if text.stopped else u.finish
            if finish == "error":
                yield _sse(ApiError(500, f"generation failed: {u.error}", type_="server_error").body())
                break
            if delta or finish is not None:
                entries = None
                if g.options.logprobs is not None:  # the tokens whose text has gone out, with this delta
                    upto = text.tokens_within()
                    entries = service.logprob_entries(logprobs[sent_logprobs:upto])
                    sent_logprobs = upto
                c = protocol.chunk(g, rid, model, delta, finish if finish != "cancelled" else "stop",
                                   logprobs=entries, offset=offset)
                offset += sum(len(e[0]) for e in entries or [])
                if delta:  # an extension field: OpenAI's clients keep it as an extra and otherwise ignore it
                    c["specdec"] = {"pieces": marks.pieces(text.sent - len(delta), delta)}
                yield _sse(c)
        if g.include_usage:
            yield _sse(protocol.chunk(g, rid, model, None, use=progress.usage(len(ids))))
        yield "data: [DONE]\n\n"
    finally:  # also when the client closed the stream: its row leaves at the next step
        if finish is None or text.stopped:
            service.engine.cancel(handle)


def _endpoint(chat: bool):
    name = "chat" if chat else "completions"

    async def handle(request: HttpRequest) -> Response:
        service: Service = request.app.state.service
        progress, deadline = _Progress(time.perf_counter()), _Deadline(service.config.request_timeout)
        try:
            body = await _body(request, service.config.max_body_bytes, deadline)
            g = protocol.parse_request(body, chat, service.models)
            ids = await run_in_threadpool(service.encode, g)
            processing = await run_in_threadpool(service.processing, g)
            max_new = service.max_new(g, len(ids))
            if deadline.left() == 0:
                raise deadline.error()
            if g.stream:
                handle_, updates = service.submit(g, ids, max_new, processing)
                response = StreamingResponse(_stream(service, g, ids, handle_, updates, progress, deadline),
                                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            else:
                response = await _whole(service, request, g, ids, max_new, progress, deadline, processing)
        except ApiError as e:
            response = _error(e)
        service.http.labels(name, str(response.status_code)).inc()
        return response

    return handle


async def _models(request: HttpRequest) -> Response:
    service: Service = request.app.state.service
    data = [{"id": m, "object": "model", "created": int(service.started), "owned_by": "specdec"} for m in service.models]
    return JSONResponse({"object": "list", "data": data})


async def _health(request: HttpRequest) -> Response:
    e = request.app.state.service.engine
    status = 503 if e.stopping else 200
    return JSONResponse({"status": "stopping" if e.stopping else "ok", "batch_size": e.counters.batch_size,
                         "queue_length": e.queue_length}, status_code=status)


async def _metrics(request: HttpRequest) -> Response:
    return Response(generate_latest(request.app.state.service.registry), media_type="text/plain; version=0.0.4")


async def _stats(request: HttpRequest) -> Response:
    service: Service = request.app.state.service
    return JSONResponse(snapshot(service.engine, service.history, service.config.engine.max_batch))


async def _page(request: HttpRequest) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_POLICY,
                                                        "Cache-Control": "no-cache"})


async def _periodic_save(service: Service) -> None:
    while True:
        await asyncio.sleep(service.cache.config.save_every)
        try:
            await asyncio.to_thread(service.cache.save)
        except OSError as e:
            log.warning("suffix cache not saved: %s", e)


async def _periodic_sample(service: Service) -> None:
    while True:
        service.history.record(Sample.of(service.engine.counters, time.perf_counter()))
        await asyncio.sleep(SAMPLE_EVERY)


async def _periodic_trim(every: float, trim: Callable[[], int]) -> None:
    while True:
        await asyncio.sleep(every)
        await asyncio.to_thread(trim)


def create_app(service: Service) -> Starlette:
    """The ASGI app; its lifespan starts the engine, and on shutdown stops it (in-flight answers get
    ``shutdown_deadline`` seconds) and saves the suffix cache."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        tasks = [asyncio.ensure_future(_periodic_sample(service))]
        if service.cache is not None:
            tasks.append(asyncio.ensure_future(_periodic_save(service)))
        trim = malloc_trim() if service.config.trim_every > 0 else None
        if trim is not None:
            tasks.append(asyncio.ensure_future(_periodic_trim(service.config.trim_every, trim)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.to_thread(service.engine.stop, service.config.shutdown_deadline)
            if service.cache is not None and service.cache.save():
                log.info("suffix cache saved: %d answers", len(service.cache.docs))

    routes = [Route("/v1/chat/completions", _endpoint(True), methods=["POST"]),
              Route("/v1/completions", _endpoint(False), methods=["POST"]),
              Route("/v1/models", _models, methods=["GET"]),
              Route("/health", _health, methods=["GET"]),
              Route("/metrics", _metrics, methods=["GET"]),
              Route("/stats", _stats, methods=["GET"]),
              Route("/", _page, methods=["GET"]),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    key = service.config.api_key
    middleware = [Middleware(_RequireKey, key=key, counter=service.http)] if key is not None else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.service = service
    return app
