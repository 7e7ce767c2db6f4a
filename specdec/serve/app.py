"""The HTTP front end: Starlette routes on uvicorn's event loop, the decode loop on its own thread.

    service = Service(decoder, tokenizer, ServeConfig(model_name="default"), cache)  # service.py
    app = create_app(service)            # an ASGI app: uvicorn.run(app, host=..., port=...)

Each request is checked for its API key (``ServeConfig.api_key``: every route but /health and the chat
page's files), read up to ``max_body_bytes``, parsed and checked (``protocol``), tokenized and its
options compiled on a worker thread (``service.Service``: a long prompt, chat template or grammar never
holds up the event loop), and queued to the ``Engine``; the engine's updates cross to the event loop
through an ``asyncio.Queue`` per request. Streaming answers are server-sent events in OpenAI's chunk
format ending with ``data: [DONE]``. A client that goes away (a closed stream, or a dropped connection
while waiting for a whole answer), or a request past its time limit (``request_timeout``), has its row
cancelled; the batch frees it at the next step. ``/`` is a chat page (``static/``) over the same API,
its chunks' ``specdec`` extension saying who wrote each piece (``provenance``), its live panel from
``/stats`` (``live``). Why Starlette and uvicorn, and the page: docs/decisions/016-server.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prometheus_client import Counter, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from specdec.processing import Processing
from specdec.runtime.memory import malloc_trim
from specdec.serve import protocol, responses
from specdec.serve.engine import Update
from specdec.serve.live import SAMPLE_EVERY, Sample, snapshot
from specdec.serve.protocol import ApiError, Generation
from specdec.serve.responses import TextStream
from specdec.serve.provenance import Provenance
from specdec.serve.service import Service

log = logging.getLogger("specdec.serve")
# answered without the API key: a load balancer's probe, and the chat page (it holds no data; it asks
# for the key, then sends it with every request it makes)
OPEN_PATHS = ("/health", "/")
STATIC = Path(__file__).parent / "static"  # the chat page's files, served under /static/
# the page loads nothing from another host, and runs no inline script (what an injected one would need)
PAGE_POLICY = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
               "frame-ancestors 'none'")


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
        return responses.usage(prompt_tokens, self.tokens, {"drafted_tokens": self.drafted,
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
    return JSONResponse(responses.completion(g, responses.new_id(g.chat), service.models[0], text.text, finish, use,
                                            entries))


async def _stream(service: Service, g: Generation, ids: list[int], handle: int, updates: asyncio.Queue,
                  progress: _Progress, deadline: _Deadline):
    rid, model = responses.new_id(g.chat), service.models[0]
    text = TextStream(service.decode, g.stop)
    logprobs, sent_logprobs, offset = [], 0, 0  # every token's so far; how many went out; their text's length
    marks = Provenance(service.decode)  # who wrote each piece: the chunks' "specdec" extension
    finish = None
    try:
        if g.chat:
            yield _sse(responses.chunk(g, rid, model, "", first=True))
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
                c = responses.chunk(g, rid, model, delta, finish if finish != "cancelled" else "stop",
                                   logprobs=entries, offset=offset)
                offset += sum(len(e[0]) for e in entries or [])
                if delta:  # an extension field: OpenAI's clients keep it as an extra and otherwise ignore it
                    c["specdec"] = {"pieces": marks.pieces(text.sent - len(delta), delta)}
                yield _sse(c)
        if g.include_usage:
            yield _sse(responses.chunk(g, rid, model, None, use=progress.usage(len(ids))))
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
