"""The client side of ``specdec bench-serve`` (``specdec.bench.serve_load``): loads sent to an
OpenAI-compatible server over loopback, one ``Sample`` measured per request, and each load's summary.

    asyncio.run(run_load(url, bodies, clients=16, per_client=20, max_seconds=1800))  # the summary, every sample

Chat requests are streamed: a request's time to first token is its first content chunk's arrival.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

RSS_METRIC = "process_resident_memory_bytes"  # Prometheus' process collector (Linux), as `specdec serve` exports it


@dataclass(frozen=True)
class Sample:
    prompt: int  # index into the prompts
    ttft: float | None  # seconds to the first content token (None: failed)
    latency: float | None  # seconds to the end of the answer
    tokens: int  # completion tokens (usage)
    text: str
    error: str | None = None
    prompt_tokens: int = 0  # usage's, where the server reports it
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens a prefix cache reused


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile: q in [0, 100]. Example: [1, 2, 3, 4], 50 -> 2; 99 -> 4."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def _one(client, url: str, body: dict, index: int) -> Sample:
    t0 = time.perf_counter()
    ttft, parts, tokens, usage = None, [], 0, {}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return Sample(index, None, None, 0, "", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(index, None, None, 0, "", chunk["error"]["message"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    tokens = usage["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
    except Exception as e:  # noqa: BLE001 -- a failed request is a data point
        return Sample(index, None, None, 0, "", f"{type(e).__name__}: {e}")
    # a server that sends no usage (another implementation): its content chunks, about one token each
    tokens = tokens or sum(1 for p in parts if p)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Sample(index, ttft, time.perf_counter() - t0, tokens, "".join(parts), None, usage.get("prompt_tokens", 0),
                  cached)


async def run_load(url: str, bodies: list[dict], clients: int, per_client: int, max_seconds: float) -> dict:
    """``clients`` concurrent clients, each sending ``per_client`` requests in turn (request i of client
    c asks bodies[(c * per_client + i) % len(bodies)]); the summary and every sample."""
    pool = _pool(clients)  # before the clock starts
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    deadline = time.perf_counter() + max_seconds
    samples: list[Sample] = []
    skipped = 0

    async def client_loop(c: int, client) -> None:
        nonlocal skipped
        for i in range(per_client):
            if time.perf_counter() > deadline:
                skipped += per_client - i
                return
            k = (c * per_client + i) % len(bodies)
            samples.append(await _one(client, endpoint, bodies[k], k))

    return summarize(samples, await _clients(pool, clients, client_loop), skipped)


def _pool(clients: int):
    """One HTTP connection pool for ``clients`` concurrent clients (and a few more connections), a request
    allowed 600 s: an ``httpx.AsyncClient`` to use as ``async with``."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=clients + 4))


async def _clients(pool, n: int, worker) -> float:
    """``worker(c, client)`` for clients c = 0..n-1 at once over ``pool`` (``_pool``'s); the wall seconds."""
    async with pool as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c, client) for c in range(n)))
        return time.perf_counter() - t0


def summarize(samples: list[Sample], wall: float, skipped: int = 0) -> dict:
    """A load's counts, tokens/s over ``wall`` seconds, p50 / p99 time to first token and per request, and
    every sample."""
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    lat = [s.latency for s in ok]
    tokens = sum(s.tokens for s in ok)
    return {"requests": len(samples), "errors": len(samples) - len(ok), "skipped": skipped, "wall_s": wall,
            "tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "first_errors": [s.error for s in samples if s.error is not None][:5],
            "samples": [asdict(s) for s in samples]}


async def _server_rss(client, url: str) -> float | None:
    """The server's resident bytes from its /metrics; None where it exports no RSS_METRIC."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(url.rstrip("/") + "/metrics")
        for family in text_string_to_metric_families(r.text):
            if family.name == RSS_METRIC and family.samples:
                return float(family.samples[0].value)
    except Exception:  # noqa: BLE001 -- a missed sample is recorded as None
        return None
    return None


async def run_soak(url: str, bodies: list[dict], clients: int, seconds: float, every: float,
                   on_sample: Callable[[list[Sample], list[tuple[float, float | None]], float], None]) -> tuple:
    """``clients`` clients sending bodies in turn, back to back, until ``seconds`` have passed; the
    server's RSS read every ``every`` seconds (and at the end), ``on_sample(samples, rss, elapsed)``
    after each. Returns (samples, rss [(seconds since the start, bytes | None)], wall)."""
    pool = _pool(clients)  # before the clock starts
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    t0 = time.perf_counter()
    deadline, turn = t0 + seconds, itertools.count()
    samples: list[Sample] = []
    rss: list[tuple[float, float | None]] = []

    async def client_loop(client) -> None:
        while time.perf_counter() < deadline:
            k = next(turn) % len(bodies)
            samples.append(await _one(client, endpoint, bodies[k], k))

    async def sampler(client) -> None:
        while True:
            now = time.perf_counter()
            rss.append((now - t0, await _server_rss(client, url)))
            on_sample(samples, rss, now - t0)
            if now >= deadline:
                return
            await asyncio.sleep(max(0.0, min(every, deadline - now)))

    async with pool as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)), sampler(client))
        wall = time.perf_counter() - t0
        rss.append((wall, await _server_rss(client, url)))  # after the last requests finished
    return samples, rss, wall


def malformed_bodies(model: str) -> list[bytes]:
    """Requests a server must refuse (4xx) and survive: one of each kind of mistake."""
    hi = [{"role": "user", "content": "hi"}]
    bad = [{"model": model}, {"model": model, "messages": "hi"}, {"model": model, "messages": [{"role": "user", "content": 5}]},
           {"model": model, "messages": [{"role": "wizard", "content": "x"}]},
           {"model": model, "messages": hi, "max_tokens": 10**9}, {"model": model, "messages": hi, "max_tokens": "5"},
           {"model": "no-such-model", "messages": hi}, {"model": model, "messages": hi, "temperature": -1},
           {"model": model, "messages": hi, "n": 3}, {"model": model, "messages": [{"role": "user", "content": ""}]},
           {"model": model, "messages": [{"role": "user", "content": "word " * 20_000}]}, [1, 2]]
    return [json.dumps(b).encode() for b in bad] + [b"{not json", b""]


async def run_malformed(url: str, model: str, count: int) -> dict:
    """``count`` malformed requests in a row (cycling ``malformed_bodies``), then a good one."""
    import httpx

    bodies, statuses = malformed_bodies(model), {}
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        t0 = time.perf_counter()
        for i in range(count):
            try:
                r = await client.post(url.rstrip("/") + "/v1/chat/completions", content=bodies[i % len(bodies)],
                                      headers=headers)
                key = str(r.status_code)
            except Exception as e:  # noqa: BLE001 -- a dropped connection is what this mode looks for
                key = type(e).__name__
            statuses[key] = statuses.get(key, 0) + 1
        wall = time.perf_counter() - t0
        good = await _one(client, url.rstrip("/") + "/v1/chat/completions",
                          {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
                           "max_tokens": 8, "temperature": 0}, 0)
    refused = sum(n for k, n in statuses.items() if k.isdigit() and 400 <= int(k) < 500)
    return {"requests": count, "statuses": statuses, "wall_s": wall, "refused_4xx": refused,
            "errors": (count - refused) + (good.error is not None), "then_served": good.error is None,
            "then_error": good.error}


def system_prompt(texts: list[str], tokens: int) -> str:
    """A shared system prompt of about ``tokens`` tokens (4 characters each): reference notes made of
    ``texts`` in turn."""
    head = "You are a careful assistant. Answer briefly, using these reference notes where they help.\n"
    notes, i = [], 0
    while len(head) + sum(len(n) + 1 for n in notes) < 4 * tokens:
        notes.append(f"Note {i + 1}: {texts[i % len(texts)]}")
        i += 1
    return (head + "\n".join(notes))[: 4 * tokens]


async def run_conversations(url: str, model: str, system: str, questions: list[str], clients: int, turns: int,
                            max_tokens: int, temperature: float, max_seconds: float) -> dict:
    """``clients`` conversations at once, ``turns`` turns each (client c's turn t asks
    questions[(c * turns + t) % len(questions)]), each turn's answer appended before the next; the
    summary: TTFT per turn, the later turns' over the first's, and every sample (``prompt`` is c * turns + t)."""
    pool = _pool(clients)  # before the clock starts
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    deadline = time.perf_counter() + max_seconds
    samples: list[Sample] = []
    skipped = 0

    async def conversation(c: int, client) -> None:
        nonlocal skipped
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            if time.perf_counter() > deadline:
                skipped += turns - t
                return
            messages.append({"role": "user", "content": questions[(c * turns + t) % len(questions)]})
            body = {"model": model, "messages": list(messages), "stream": True, "max_tokens": max_tokens,
                    "stream_options": {"include_usage": True}, "temperature": temperature, "seed": 0}
            s = await _one(client, endpoint, body, c * turns + t)
            samples.append(s)
            if s.error is not None:  # the conversation cannot go on without its answer
                skipped += turns - t - 1
                return
            messages.append({"role": "assistant", "content": s.text})

    return summarize(samples, await _clients(pool, clients, conversation), skipped) | turn_summary(samples, turns)


def turn_summary(samples: list[Sample], turns: int) -> dict:
    """TTFT p50 per turn, the later turns' p50 over the first turn's, and the prompt tokens reported
    cached. Example: turn p50s [2.0, 0.4, 0.5] -> later 0.4 or 0.5 (p50 of every later sample) / 2.0."""
    ok = [s for s in samples if s.error is None and s.ttft is not None]
    per_turn = [percentile([s.ttft for s in ok if s.prompt % turns == t], 50) for t in range(turns)]
    first = per_turn[0]
    later = percentile([s.ttft for s in ok if s.prompt % turns > 0], 50)
    return {"turns": turns, "ttft_p50_by_turn_s": per_turn, "ttft_first_turn_p50_s": first,
            "ttft_later_turns_p50_s": later,
            "later_over_first": later / first if first and later is not None else None,
            "prompt_tokens": sum(s.prompt_tokens for s in ok), "cached_tokens": sum(s.cached_tokens for s in ok),
            "first_turn_prompt_tokens": percentile([s.prompt_tokens for s in ok if s.prompt % turns == 0], 50)}
