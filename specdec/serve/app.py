"""The HTTP front end: Starlette routes on uvicorn's event loop, the decode loop on its own thread.

    service = Service(decoder, tokenizer, ServeConfig(model_name="default"), cache)
    app = create_app(service)            # an ASGI app: uvicorn.run(app, host=..., port=...)

Each request is parsed and checked (``protocol``), tokenized, and queued to the ``Engine``; the
engine's updates cross to the event loop through an ``asyncio.Queue`` per request. Streaming answers
are server-sent events in OpenAI's chunk format ending with ``data: [DONE]``. A client that goes away
(a closed stream, or a dropped connection while waiting for a whole answer) has its row cancelled;
the batch frees it at the next step. Why Starlette and uvicorn: docs/decisions/016-server.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec.prompting import chat_ids, context_window, eos_ids, has_chat_template
from specdec.runtime.memory import malloc_trim
from specdec.serve import protocol
from specdec.serve.cache import ServedCache
from specdec.serve.engine import Busy, Engine, EngineConfig, Request, Update
from specdec.serve.protocol import ApiError, Generation, TextStream

log = logging.getLogger("specdec.serve")


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


class Service:
    """What the routes share: the engine, the tokenizer, the cache and the metrics."""

    def __init__(self, decoder, tokenizer, config: ServeConfig = ServeConfig(),
                 cache: ServedCache | None = None) -> None:
        self.tokenizer, self.config, self.cache = tokenizer, config, cache
        # positions a request may reach: the context window, or a sliding window the store does not implement
        windows = [w for w in (context_window(decoder.target), decoder.sliding_window) if w is not None]
        self.window = min(windows) if windows else None
        on_finished = cache.remember if cache is not None and cache.active else None
        self.engine = Engine(decoder, set(eos_ids(decoder.target, tokenizer)), config.engine, on_finished)
        self.models = (config.model_name,)
        self.registry = CollectorRegistry()
        self.http = Counter("specdec_http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(self.engine))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (Linux): the soak reads it
        self.started = time.time()

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def encode(self, g: Generation) -> list[int]:
        """The prompt's ids, checked against the context window; ApiError otherwise."""
        if g.chat:
            if not any(m["content"].strip() for m in g.messages):
                raise ApiError(400, "the messages hold no text (empty prompt)", "messages")
            if has_chat_template(self.tokenizer):
                ids = chat_ids(self.tokenizer, g.messages)[0].tolist()
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

    def max_new(self, g: Generation, prompt_tokens: int) -> int:
        room = self.window - prompt_tokens if self.window is not None else None
        if g.max_tokens is None:
            return self.config.default_max_tokens if room is None else min(self.config.default_max_tokens, room)
        if room is not None and g.max_tokens > room:
            raise ApiError(400, f"max_tokens {g.max_tokens} + the prompt's {prompt_tokens} tokens pass this model's "
                                f"context window of {self.window} tokens (at most {room} here)", "max_tokens",
                           "context_length_exceeded")
        return g.max_tokens

    def submit(self, g: Generation, ids: list[int], max_new: int) -> tuple[int, asyncio.Queue]:
        """Queue the generation; its handle and the queue its updates arrive on (Busy: 429 / 503)."""
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()

        def emit(u: Update) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(updates.put_nowait, u)

        try:
            handle = self.engine.submit(Request(ids, max_new, g.sampling, g.seed, emit))
        except Busy as e:
            raise ApiError(503 if e.shutting_down else 429, str(e), None, "server_busy",
                           "server_error" if e.shutting_down else "rate_limit_error",
                           {"Retry-After": str(e.retry_after)}) from None
        return handle, updates


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


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _body(request: HttpRequest):
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client goes away (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(service: Service, request: HttpRequest, g: Generation, ids: list[int], max_new: int) -> Response:
    handle, updates = service.submit(g, ids, max_new)
    text = TextStream(service.decode, g.stop)
    gone = asyncio.ensure_future(_disconnected(request))
    n, finish = 0, None
    try:
        while finish is None:
            get = asyncio.ensure_future(updates.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the client went away: free its row
                get.cancel()
                service.engine.cancel(handle)
                return Response(status_code=499)
            u = get.result()
            n += len(u.tokens)
            text.feed(u.tokens, final=u.finish is not None)
            finish = "stop" if text.stopped else u.finish
        if finish == "error":
            raise ApiError(500, f"generation failed: {u.error}", type_="server_error")
    finally:
        gone.cancel()
        if finish is None or text.stopped:
            service.engine.cancel(handle)
    use = protocol.usage(len(ids), n)
    return JSONResponse(protocol.completion(g, protocol.new_id(g.chat), service.models[0], text.text, finish, use))


async def _stream(service: Service, g: Generation, ids: list[int], handle: int, updates: asyncio.Queue):
    rid, model = protocol.new_id(g.chat), service.models[0]
    text = TextStream(service.decode, g.stop)
    n, finish = 0, None
    try:
        if g.chat:
            yield _sse(protocol.chunk(g, rid, model, "", first=True))
        while finish is None:
            u = await updates.get()
            n += len(u.tokens)
            delta = text.feed(u.tokens, final=u.finish is not None)
            finish = "stop" if text.stopped else u.finish
            if finish == "error":
                yield _sse(ApiError(500, f"generation failed: {u.error}", type_="server_error").body())
                break
            if delta or finish is not None:
                yield _sse(protocol.chunk(g, rid, model, delta, finish if finish != "cancelled" else "stop"))
        if g.include_usage:
            yield _sse(protocol.chunk(g, rid, model, None, use=protocol.usage(len(ids), n)))
        yield "data: [DONE]\n\n"
    finally:  # also when the client closed the stream: its row leaves at the next step
        if finish is None or text.stopped:
            service.engine.cancel(handle)


def _endpoint(chat: bool):
    name = "chat" if chat else "completions"

    async def handle(request: HttpRequest) -> Response:
        service: Service = request.app.state.service
        try:
            g = protocol.parse_request(await _body(request), chat, service.models)
            ids = service.encode(g)
            max_new = service.max_new(g, len(ids))
            if g.stream:
                handle_, updates = service.submit(g, ids, max_new)
                response = StreamingResponse(_stream(service, g, ids, handle_, updates), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
            else:
                response = await _whole(service, request, g, ids, max_new)
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


async def _periodic_save(service: Service) -> None:
    while True:
        await asyncio.sleep(service.cache.config.save_every)
        try:
            await asyncio.to_thread(service.cache.save)
        except OSError as e:
            log.warning("suffix cache not saved: %s", e)


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
        tasks = [asyncio.ensure_future(_periodic_save(service))] if service.cache is not None else []
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
              Route("/metrics", _metrics, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = service
    return app
