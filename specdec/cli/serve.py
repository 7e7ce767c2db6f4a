"""`specdec serve`: an OpenAI-compatible HTTP server (chat and completions, streaming or not) over
one continuously batched decode loop; the suffix drafter's memory of served text persists across
restarts (``--no-suffix-cache`` opts out); prompt rows are reused across requests (``--prefix-cache-mb``,
``specdec.kv.prefix``). ``--api-key`` / ``--api-key-file``, ``--max-body-bytes``,
``--request-timeout`` and ``--max-connections`` make it fit to face other people (no TLS: see README).
``--replicas N`` runs N such engines as Ray Serve replicas behind one endpoint (``specdec.serve.replicas``;
``pip install 'specdec[ray]'``), on a local Ray or a cluster's (``--ray-address``)."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from specdec.arguments import add_weights_argument, non_negative_float, non_negative_int, positive_int, weights_for
from specdec.registry import DRAFTERS, make_drafter


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    add_weights_argument(p)
    p.add_argument("--drafter", default="auto", choices=sorted(DRAFTERS))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients name (default: --model)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="live requests decoded together at most")
    p.add_argument("--max-queue", type=non_negative_int, default=64,
                   help="requests waiting for a batch row at most; beyond it: 429 with Retry-After")
    p.add_argument("--default-max-tokens", type=positive_int, default=512,
                   help="answer length for requests naming no max_tokens (clipped to the context window)")
    p.add_argument("--cache-dir", default=None,
                   help="folder of the persisted suffix cache (default: specdec's cache folder /serve)")
    p.add_argument("--no-suffix-cache", action="store_true",
                   help="served text is not remembered (nor loaded or saved): each answer drafts as if first asked")
    p.add_argument("--cache-max-tokens", type=positive_int, default=1_000_000,
                   help="served tokens the suffix cache keeps; the oldest answers are evicted beyond it")
    p.add_argument("--save-every", type=positive_int, default=300, help="seconds between cache saves")
    p.add_argument("--prefix-cache-mb", type=non_negative_int, default=PREFIX_CACHE_MB,
                   help="MiB of prompt K/V rows kept for later requests that start with the same tokens (a "
                        "conversation's earlier turns, a shared system prompt: only the rest is prefilled; "
                        "answers unchanged, bit for bit); least recently used first out; 0: off")
    p.add_argument("--shutdown-timeout", type=positive_int, default=10,
                   help="seconds in-flight answers get to finish on SIGTERM/SIGINT before they are cancelled")
    p.add_argument("--trim-every", type=non_negative_float, default=0.0,
                   help="seconds between returning freed memory to the system (glibc's malloc_trim; 0: never, "
                        "the default: it lowers RSS peaks and costs throughput under load)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="clients must send 'Authorization: Bearer KEY' (every route but /health; 401 otherwise); "
                          "visible to other local users in the process list: prefer --api-key-file")
    key.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    p.add_argument("--max-body-bytes", type=positive_int, default=8 * 2**20,
                   help="request bodies larger than this are refused (413) before they are read (default 8 MiB)")
    p.add_argument("--request-timeout", type=non_negative_float, default=0.0,
                   help="seconds a request may take from arrival to its last token; then it is cancelled "
                        "(504; a stream ends with an error event). 0: no limit (the default)")
    p.add_argument("--max-connections", type=non_negative_int, default=0,
                   help="open connections at most (uvicorn's limit_concurrency; beyond it: 503); "
                        "0: --max-batch + --max-queue + 32")
    p.add_argument("--replicas", type=positive_int, default=None,
                   help="run this many engines as Ray Serve replicas behind one endpoint (needs specdec[ray]); a "
                        "conversation goes to the replica holding its prefix, Ray restarts a replica that dies, "
                        "each replica's suffix cache is a file in --cache-dir (a folder they all reach)")
    p.add_argument("--replica-cpus", type=positive_int, default=1,
                   help="with --replicas: CPUs Ray reserves for each replica, and its torch threads")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: the Ray cluster to run on ('auto': the one started on this machine "
                        "with 'ray start'; 'ray://HOST:10001' or HOST:6379: another's); default: a new local Ray")


# ~11k tokens of the default model (46 KB a token): a 1,500-token system prompt and eight conversations
PREFIX_CACHE_MB = 512


def prefix_cache(args):
    """The prefix cache --prefix-cache-mb asks for (None: 0)."""
    from specdec.kv.prefix import PrefixCache

    return PrefixCache(args.prefix_cache_mb * 2**20) if args.prefix_cache_mb else None


def api_key(args) -> str | None:
    """The key from --api-key or --api-key-file (its first line, stripped); None: no key."""
    if args.api_key_file is None:
        key = args.api_key
    else:
        lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        key = lines[0] if lines else ""
        if not key.strip():
            raise ValueError(f"--api-key-file {args.api_key_file}: the file's first line is empty")
    if key is not None and not key.strip():
        raise ValueError("--api-key is empty")
    return None if key is None else key.strip()


def serve_config(args):
    """The server's settings from the command line (specdec.serve.service.ServeConfig)."""
    from specdec.serve.engine import EngineConfig
    from specdec.serve.service import ServeConfig

    return ServeConfig(args.model_name or args.model, args.default_max_tokens,
                       EngineConfig(args.max_batch, args.max_queue), float(args.shutdown_timeout), args.trim_every,
                       api_key(args), args.max_body_bytes, args.request_timeout)


def uvicorn_options(args) -> dict:
    """uvicorn.run's keywords: where to listen, the graceful-shutdown timeout, the connection limit."""
    connections = args.max_connections or args.max_batch + args.max_queue + 32  # room for /health, /metrics, 429s
    return {"host": args.host, "port": args.port, "log_level": "info",
            "timeout_graceful_shutdown": args.shutdown_timeout, "limit_concurrency": connections}


def build_app(args, replica: int | None = None):
    """The server's ASGI app from the command line: the model loaded, the decoder warmed up, the suffix
    cache loaded. ``replica``: this app is Ray replica ``replica``'s (``--replicas``); its suffix cache is
    the file ``replica-<rank>/suffix-cache.json`` of the shared folder."""
    from specdec.decoder import SpecDecoder, SpecDecoderConfig
    from specdec.drafters.corpus import vocab_fingerprint
    from specdec.models import load_model
    from specdec.runtime import kernels
    from specdec.serve.app import create_app
    from specdec.serve.cache import CACHE_FILE, CacheConfig, ServedCache, suffix_drafters
    from specdec.serve.service import Service

    log = logging.getLogger("specdec.serve")
    config = serve_config(args)
    loaded = load_model(args.model, weights=weights_for(args.model, args.weights), numerics=args.numerics)
    decoder = SpecDecoder(loaded.model, make_drafter(args.drafter, loaded.model), SpecDecoderConfig(runtime=args.runtime),
                          prefix_cache=prefix_cache(args))
    if decoder.prefix_cache is not None and decoder.reads_hidden:
        log.warning("the prefix cache stays unused: drafter %s reads the prompt's hidden states, which it does not keep",
                    args.drafter)
    log.info("preparing the CPU kernels and packed weights ...")
    kernels.prepare()
    decoder.warm_up()
    folder = Path(args.cache_dir) if args.cache_dir else Path(args.runtime.cache_dir) / "serve"
    if replica is not None:
        folder = folder / f"replica-{replica}"
    cache = None
    if not args.no_suffix_cache:
        path = folder / CACHE_FILE
        cache = ServedCache(suffix_drafters(decoder.drafter), vocab_fingerprint(loaded.tokenizer),
                            CacheConfig(path, args.cache_max_tokens, float(args.save_every)))
        if cache.active:
            log.info("suffix cache %s: %d answers loaded", path, cache.load())
    return create_app(Service(decoder, loaded.tokenizer, config, cache))


def run(args) -> int:
    try:
        import uvicorn
    except ModuleNotFoundError:
        raise ValueError("specdec serve needs its HTTP stack: pip install 'specdec[serve]'") from None

    config, options = serve_config(args), uvicorn_options(args)  # bad options fail before the model loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("specdec.serve")
    if config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no --api-key: anyone who reaches %s:%d can use this server", args.host, args.port)
    if args.replicas is not None or args.ray_address is not None:
        return run_replicas(args, config)
    app = build_app(args)
    log.info("serving %s (drafter %s) on http://%s:%d/v1%s", config.model_name, args.drafter, args.host, args.port,
             "" if config.api_key is None else " (API key required)")
    # uvicorn handles SIGTERM / SIGINT: stop accepting, let open requests finish (up to the timeout),
    # then the app's lifespan stops the engine and saves the cache
    try:
        uvicorn.run(app, **options)
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has shut down gracefully
        pass
    return 0


def replica_options(args, config):
    """--replicas' settings (specdec.serve.replicas.ReplicaOptions): Ray hands a replica at most its batch
    and queue; the router checks the key and the body size as a replica would."""
    from specdec.serve.replicas import ReplicaOptions

    return ReplicaOptions(args.replicas or 1, float(args.replica_cpus), args.max_batch + args.max_queue,
                          config.api_key, config.max_body_bytes, args.runtime)


def run_replicas(args, config) -> int:
    """``--replicas N``: N engines on Ray Serve behind one endpoint (specdec.serve.replicas)."""
    try:
        from ray import serve  # noqa: F401 -- only to say what is missing
    except ModuleNotFoundError:
        raise ValueError("specdec serve --replicas needs Ray Serve: pip install 'specdec[ray]'") from None
    from specdec.serve.replicas import build_application, run as run_on_ray

    log = logging.getLogger("specdec.serve")
    options = replica_options(args, config)
    # each replica loads the model in its own process (build_app, with its rank): on a cluster the same
    # files must be on every machine, and --cache-dir a folder they all reach
    application = build_application(partial(build_app, args), options)
    log.info("starting %d replicas of %s (drafter %s) on Ray Serve at http://%s:%d/v1%s", options.replicas,
             config.model_name, args.drafter, args.host, args.port,
             "" if config.api_key is None else " (API key required)")
    run_on_ray(application, args.host, args.port, args.ray_address,
               num_cpus=None if args.ray_address else options.replicas * args.replica_cpus)
    return 0
