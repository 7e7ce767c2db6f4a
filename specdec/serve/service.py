"""The served model: what the HTTP routes share, apart from HTTP.

    service = Service(decoder, tokenizer, ServeConfig(model_name="default"), cache)
    app = create_app(service)            # app.py: the routes over it

``ServeConfig`` is the server's settings. ``Service`` holds the engine, the tokenizer, the suffix cache
and the Prometheus registry, and does a request's model-side work once ``protocol`` has parsed it:
the prompt tokenized and checked against the context window (``encode``; a prompt too long to fit is
refused before it is tokenized), the options compiled or refused (``processing``: penalties, biases, a
constraint, logprobs; a constraint's compiled grammar kept for the requests that repeat it, ``GrammarCache``),
the answer's length checked (``max_new``), and the generation queued to the
``Engine`` (``submit``: 429 / 503 when it is busy). Every refusal is an ``ApiError`` in OpenAI's error
shape; the routes (``app``) answer it. The engine's counters reach /metrics through ``_EngineCollector``, the
grammar cache's through ``_GrammarCacheCollector``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.processing import ConstraintError, Processing, Vocabulary
from specdec.processing.grammar import GrammarCache
from specdec.prompting import chat_ids, context_window, eos_ids, has_chat_template
from specdec.serve.cache import ServedCache
from specdec.serve.engine import Busy, Engine, EngineConfig, Request, Update
from specdec.serve.live import History
from specdec.serve.protocol import ApiError, Generation

try:
    from jinja2 import TemplateError  # what a chat template raises on messages it refuses
except ModuleNotFoundError:  # no chat templates without jinja2 either
    TemplateError = ()


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
    # compiled constraints kept, the least recently used dropped past it (0: each request compiles its own); a
    # JSON schema took 0.5-6 ms to compile for a 49k-token vocabulary, a hit 5-30 us (decision 020)
    grammar_cache_size: int = 64

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        if self.grammar_cache_size < 0:
            raise ValueError(f"need grammar_cache_size >= 0, got {self.grammar_cache_size}")
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
        self.grammars = GrammarCache(config.grammar_cache_size)  # compiled constraints, shared by requests
        self.models = (config.model_name,)
        self.registry = CollectorRegistry()
        self.http = Counter("specdec_http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(self.engine))
        self.registry.register(_GrammarCacheCollector(self.grammars))
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
                grammar = self.grammars.compile(o.constraint, self.vocabulary())
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


class _GrammarCacheCollector:
    """The grammar cache's counts as Prometheus metrics, read at each scrape."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache

    def collect(self):
        c = self.cache
        yield CounterMetricFamily("specdec_grammar_cache_hits", "constraints whose compiled grammar was cached",
                                  value=c.hits)
        yield CounterMetricFamily("specdec_grammar_cache_misses", "constraints compiled (refused ones too)",
                                  value=c.misses)
        yield CounterMetricFamily("specdec_grammar_cache_evictions", "compiled grammars dropped (least recently used)",
                                  value=c.evictions)
        yield GaugeMetricFamily("specdec_grammar_cache_entries", "compiled grammars held", value=len(c))
        yield GaugeMetricFamily("specdec_grammar_cache_max_entries", "the bound (ServeConfig.grammar_cache_size)",
                                value=c.max_entries)


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

