"""`specdec serve --replicas N`: N engines as Ray Serve replicas behind one OpenAI-compatible endpoint.

    app = build_application(partial(my_app, ...), ReplicaOptions(replicas=2))  # my_app(rank) -> create_app(...)
    run(app, host="0.0.0.0", port=8000, ray_address="auto")                    # or serve.run(app) yourself

Two deployments, no server of their own:

- ``Engine`` (N replicas): each builds the single-process server's ASGI app (``app.create_app``: the
  decode thread, the prefix cache, the suffix cache, every check and limit) from a factory called
  with the replica's rank, runs its lifespan, and answers forwarded HTTP requests by calling that app
  in-process (``call_app``), streaming its response back. Ray restarts a replica whose process dies or
  whose ``check_health`` fails (the decode loop stopped); the replacement takes the free rank, and with
  it the rank's suffix-cache file in the folder the replicas share.
- ``Router`` (the HTTP ingress, thin): checks the API key and the body size, takes a conversation's key
  from the body (``route_key``: the messages up to the first user message, or a prompt's first
  characters) and calls ``Engine`` with it as Ray's session id; Ray's consistent-hash request router
  sends every request of that key to one replica, the one whose prefix cache holds its earlier turns.
  A replica that dies under a request: 503 in OpenAI's error shape (a stream already under way ends
  with an error event); the next request of that conversation goes to a live replica.

Ray is imported only inside the functions and methods that need it: ``route_key`` and ``call_app``
work (and are tested) without it. Why Ray Serve this way, and what was measured:
docs/decisions/024-ray-serve.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from specdec.config import RuntimeConfig, hub_offline, use
from specdec.serve.app import KeyCheck, read_body
from specdec.serve.protocol import ApiError

log = logging.getLogger("specdec.serve")
# the routes whose body names a conversation; any other request goes to any replica
KEYED_PATHS = ("/v1/chat/completions", "/v1/completions")
# a completion prompt's key: its first characters (a shared preamble of this length shares a replica,
# where its prefix-cache blocks are); ~100 tokens, more than one 64-token prefix block
KEY_CHARS = 512
# Ray's own request router for session affinity: a consistent-hash ring over the live replicas, so a
# replica that leaves moves only its own keys
CONSISTENT_HASH = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
# what a forwarded response's first item is (then its body's chunks, bytes)
Head = dict


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int = 2  # engine replicas (Ray Serve's num_replicas)
    cpus: float = 1.0  # Ray CPUs each replica reserves; its torch threads: this, at least 1
    # concurrent requests Ray hands one replica: its batch + queue (the engine's own limits answer
    # beyond that with 429, as a single server does)
    max_ongoing: int = 8 + 64
    api_key: str | None = field(default=None, repr=False)  # checked at the router too: no body read without it
    max_body_bytes: int = 8 * 2**20  # the router reads no more of a body than a replica would take
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # each replica's (read at the CLI's edge)
    health_check_period_s: float = 5.0  # Ray calls Engine.check_health this often ...
    health_check_timeout_s: float = 30.0  # ... and restarts the replica after a failure or this long a wait
    env: dict[str, str] = field(default_factory=lambda: {"HF_HUB_OFFLINE": "1"})  # each replica's process

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.cpus <= 0 or self.max_ongoing < 1:
            raise ValueError(f"need replicas >= 1, cpus > 0 and max_ongoing >= 1: {self}")


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the router hands it to a replica (its body read whole, within the limit)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]  # ASGI's raw headers, lower-case names
    body: bytes


def route_key(path: str, body: bytes) -> str | None:
    """The conversation a request belongs to, as a short stable string; None: any replica will do.

    Chat: the messages up to and including the first user message (a system prompt, tool descriptions,
    the opening question): every later turn of the conversation resends them unchanged, so all its turns
    meet the prefix-cache rows of the earlier ones; two conversations with one system prompt but
    different openings spread over the replicas (each replica prefills the shared prompt once).
    Completions: the prompt's first ``KEY_CHARS`` characters. A body that is not such JSON: None (the
    replica it reaches answers it with the single server's 400).

        route_key("/v1/chat/completions", b'{"messages": [{"role": "system", "content": "S"},
                  {"role": "user", "content": "hi"}, {"role": "assistant", ...}, ...]}')
        -> sha256 of the first two messages' canonical JSON
    """
    if path not in KEYED_PATHS:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # the replica says what is wrong with it
        return None
    if not isinstance(doc, dict):
        return None
    if path == "/v1/chat/completions":
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          len(messages) - 1)
        head = messages[: first_user + 1]
    else:
        prompt = doc.get("prompt")  # a text, token ids, or a list of either (then its first)
        head = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else prompt
        if isinstance(head, str):
            head = head[:KEY_CHARS]
        elif isinstance(head, list):  # token ids: ~4 characters a token
            head = head[: KEY_CHARS // 4]
        else:
            return None
    try:
        canonical = json.dumps(head, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _scope(r: Forwarded) -> dict:
    """The ASGI scope of a forwarded request. ``spec_version`` 2.4: a response learns of a gone client
    when its ``send`` raises OSError (Starlette's streaming response stops there)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": r.method, "scheme": "http", "path": r.path, "raw_path": r.path.encode("utf-8"),
            "query_string": r.query, "root_path": "", "headers": list(r.headers), "client": None, "server": None}


async def call_app(app, request: Forwarded) -> AsyncIterator[Head | bytes]:
    """Run one request through an ASGI app in this process: its response's head first ({"status",
    "headers"}), then its body's chunks as the app sends them.

    Closing the iterator early (the caller went away, or Ray cancelled the call) is a client disconnect
    to the app: ``receive`` answers ``http.disconnect`` and ``send`` raises OSError, so the app's own
    handling runs (the request's row leaves the batch at the next step)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # the body was read: the next message is the disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            raise OSError("the client went away")
        await out.put(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))  # the app returned (or raised) before a whole response
    try:
        while (message := await out.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        task.result()  # raises what the app raised
        raise RuntimeError("the app returned without a whole response")
    finally:
        gone.set()
        if not task.done():  # give its own cleanup (cancel the row, count the request) a moment
            await asyncio.wait({task}, timeout=5)
            task.cancel()


class _Lifespan:
    """An ASGI app's lifespan driven by hand (startup at a replica's start, shutdown at its end)."""

    def __init__(self, app) -> None:
        self.app = app
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Future | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self.outbox.put))
        await self._exchange("lifespan.startup")

    async def shutdown(self) -> None:
        if self.task is not None and not self.task.done():
            await self._exchange("lifespan.shutdown")

    async def _exchange(self, event: str) -> None:
        await self.inbox.put({"type": event})
        answer = asyncio.ensure_future(self.outbox.get())
        await asyncio.wait({answer, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            answer.cancel()
            self.task.result()  # the app raised
            raise RuntimeError(f"the app ended its lifespan at {event}")
        message = answer.result()
        if message["type"] != f"{event}.complete":
            raise RuntimeError(f"{event} failed: {message.get('message', message['type'])}")


class Engine:
    """A Ray Serve replica: one single-process server's app, answering ``http`` calls from the router."""

    async def __init__(self, make_app: Callable[[int], Any], runtime: RuntimeConfig, threads: int) -> None:
        import torch
        from ray import serve

        hub_offline()  # a replica is a process's edge, as the CLI is: models load from files on disk
        torch.set_num_threads(threads)  # what Ray reserved for it; torch would take every core
        rank = serve.get_replica_context().rank
        self.rank = int(getattr(rank, "rank", rank))  # ReplicaRank (Ray >= 2.5x) or an int
        with use(runtime):
            app = make_app(self.rank)
        self.app = _under(runtime, app)
        self.service = app.state.service  # the single server's (engine, counters)
        self.lifespan = _Lifespan(self.app)
        await self.lifespan.startup()
        log.info("replica %d serving (%d threads)", self.rank, threads)

    async def http(self, request: Forwarded) -> AsyncIterator[Head | bytes]:
        async for item in call_app(self.app, request):
            if isinstance(item, dict):  # which replica answered: for logs, clients and tests
                item["headers"].append((b"x-specdec-replica", str(self.rank).encode()))
            yield item

    def check_health(self) -> None:
        """Ray calls this every ``health_check_period_s``; raising makes Ray replace the replica."""
        if self.service.engine.stopping:
            raise RuntimeError(f"replica {self.rank}: the decode loop has stopped")

    async def __del__(self) -> None:  # Ray's graceful stop: in-flight answers finish, the suffix cache is saved
        if hasattr(self, "lifespan"):  # (not when __init__ failed)
            await self.lifespan.shutdown()


def _under(runtime: RuntimeConfig, app):
    """``app`` run inside a ``use(runtime)`` block per call, as the CLI runs the single server: each call
    is one task (``call_app``'s, the lifespan's), so the block opens and closes in one context, and the
    engine thread the lifespan starts takes it with it."""

    async def scoped(scope, receive, send) -> None:
        with use(runtime):
            await app(scope, receive, send)

    return scoped


class Router:
    """The HTTP ingress: key check, body limit, conversation key, then the replica Ray's router picks."""

    def __init__(self, engine, options: ReplicaOptions) -> None:
        self.engine = engine  # a DeploymentHandle of Engine
        self.key = None if options.api_key is None else KeyCheck(options.api_key)
        self.max_body_bytes = options.max_body_bytes

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        scope = request.scope
        try:
            if self.key is not None and (refused := self.key.refusal(scope)) is not None:
                raise refused
            body = await read_body(request, self.max_body_bytes)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        forwarded = Forwarded(request.method, scope["path"], scope.get("query_string", b""),
                              list(scope["headers"]), body)
        key = route_key(forwarded.path, body)
        handle = self.engine.options(stream=True, **({"session_id": key} if key else {}))
        return await self._answer(handle.http.remote(forwarded))

    async def _answer(self, responses):
        from ray.exceptions import RayError
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            head = await responses.__anext__()
        except RayError as e:  # the replica died (or its call failed) before answering
            responses.cancel()
            error = _replica_failed(e)
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        streaming = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in head["headers"])

        async def body():
            done = False
            try:
                async for chunk in responses:
                    yield chunk
                done = True
            except RayError as e:  # the status is sent: a stream ends with OpenAI's error event
                log.warning("a replica failed during a response: %s", e)
                if streaming:
                    yield f"data: {json.dumps(_replica_failed(e).body())}\n\n".encode()
            finally:
                if not done:  # the client went away: the replica's call is cancelled (its row leaves)
                    responses.cancel()

        response = StreamingResponse(body(), status_code=head["status"])
        response.raw_headers = head["headers"]  # the replica's, as they are (content-length: the same bytes follow)
        return response


def _replica_failed(e: Exception) -> ApiError:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    if isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError)):
        return ApiError(503, "the replica answering this conversation stopped (its process ended); Ray is "
                             "starting another: retry the request", None, "replica_unavailable", "server_error",
                        {"Retry-After": "1"})
    return ApiError(500, f"the replica's call failed: {type(e).__name__}: {e}", None, "replica_error", "server_error")


def build_application(make_app: Callable[[int], Any], options: ReplicaOptions = ReplicaOptions()):
    """The Ray Serve application: the router over ``options.replicas`` engines. ``make_app(rank)`` runs on
    each replica and returns ``app.create_app(...)``'s app (it must pickle: a module-level function, or a
    ``functools.partial`` of one)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    engine = serve.deployment(Engine, name="SpecdecEngine").options(
        num_replicas=options.replicas, max_ongoing_requests=options.max_ongoing,
        ray_actor_options={"num_cpus": options.cpus, "runtime_env": {"env_vars": dict(options.env)}},
        health_check_period_s=options.health_check_period_s, health_check_timeout_s=options.health_check_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=CONSISTENT_HASH))
    # the router only forwards bytes: no CPU of its own reserved, many requests at a time
    router = serve.deployment(Router, name="SpecdecRouter").options(
        num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    threads = max(1, int(options.cpus))
    return router.bind(engine.bind(make_app, options.runtime, threads), options)


def run(application, host: str, port: int, ray_address: str | None = None, num_cpus: int | None = None,
        ready: Callable[[], None] | None = None) -> None:
    """Start Ray (``ray_address``: a running cluster's, "auto" for the local one; None: a new local one
    with ``num_cpus``), Serve's HTTP proxy on ``host``:``port``, and the application; blocks until
    SIGINT / SIGTERM, then shuts the application down (each replica's lifespan saves its cache)."""
    import signal
    import threading

    import ray
    from ray import serve

    ray.init(address=ray_address, num_cpus=None if ray_address else num_cpus, include_dashboard=False,
             log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        started = time.perf_counter()
        serve.run(application, name="specdec", route_prefix="/")
        log.info("replicas ready in %.1f s", time.perf_counter() - started)
        if ready is not None:
            ready()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
