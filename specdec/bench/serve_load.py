"""`specdec bench-serve`: load on a running `specdec serve` over loopback, against the same load one
request at a time.

    specdec serve --model default --drafter auto &                 # in another shell
    specdec bench-serve --url http://127.0.0.1:8000 --clients 16 --requests 20 --out serve_load.json

N clients each send M chat requests back to back (streaming, so time to first token is measured), with
questions taken in turn from a question file (default: the shipped set; ``--questions`` a Spec-Bench
file); then the same N x M requests are sent one at a time. Reported per mode: errors, p50 / p99 time
to first token and per request, total tokens/s (usage counts over the wall time); the concurrent /
sequential tokens/s ratio; and, greedy (``--temperature 0``), whether every answer is the same in
both modes. Any OpenAI-compatible server can be measured (e.g. llama.cpp's ``llama-server`` on a GGUF
of the same weights); without usage counts its content chunks are counted as tokens. ``--max-seconds`` bounds each mode (requests not started by then are skipped and counted).

``--modes soak``: the N clients send requests back to back for ``--soak-seconds`` while the server's
resident memory is read from its ``/metrics`` (``process_resident_memory_bytes``) every
``--sample-every`` seconds; the growth after ``--warmup-seconds`` (the largest sample after it over the
first one at or after it) is what a bounded server keeps small. The JSON is rewritten (atomically)
after every sample, so a long soak that is stopped keeps what it measured.

``--modes multiturn``: N clients each hold a ``--turns``-turn conversation whose first message is one
shared system prompt of about ``--system-tokens`` tokens (text from the question file), each turn's
answer appended before the next question, as a chat client resends the whole conversation. Reported:
time to first token per turn (p50), the later turns' over the first's, tokens/s, and the prompt tokens
the server reported cached (``usage.prompt_tokens_details.cached_tokens``). With ``--baseline-url`` (the
same server started with ``--prefix-cache-mb 0``) the same conversations run there too: the TTFT
ratios side by side, the tokens/s ratio, and (greedy) whether every turn's answer is the same.

    specdec serve --port 8000 &  specdec serve --port 8001 --prefix-cache-mb 0 &
    specdec bench-serve --modes multiturn --clients 8 --turns 8 --baseline-url http://127.0.0.1:8001

``--modes malformed``: ``--malformed N`` bad requests in a row (``MALFORMED``: broken JSON, wrong types,
out-of-range values, an unknown model, an empty and an over-long prompt), the status of each counted,
then one good request that must be answered: a server that keeps serving answers every bad one with a
4xx and the good one with 200.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from specdec.arguments import name_list, non_negative_float, positive_int
from specdec.bench.questions import load_questions
from specdec.jsonl import write_json_atomic

RSS_METRIC = "process_resident_memory_bytes"  # Prometheus' process collector (Linux), as `specdec serve` exports it
MODES = ("concurrent", "sequential", "soak", "malformed", "multiturn")


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default="default", help="the model id the server answers to")
    p.add_argument("--clients", type=positive_int, default=16)
    p.add_argument("--requests", type=positive_int, default=20, help="requests per client")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--questions", default=None, help="a question JSONL (default: the shipped set)")
    p.add_argument("--max-seconds", type=non_negative_float, default=1800.0, help="time bound per mode")
    p.add_argument("--modes", type=name_list, default=["concurrent", "sequential"],
                   help="concurrent, sequential, soak, malformed, multiturn (in that order). The server remembers what it served "
                        "(suffix cache): compare the modes on servers started with --no-suffix-cache, or one "
                        "mode per fresh server")
    p.add_argument("--soak-seconds", type=non_negative_float, default=1800.0, help="soak: how long the load runs")
    p.add_argument("--warmup-seconds", type=non_negative_float, default=300.0,
                   help="soak: memory growth is measured from the first sample at or after this time")
    p.add_argument("--sample-every", type=non_negative_float, default=10.0, help="soak: seconds between RSS samples")
    p.add_argument("--malformed", type=positive_int, default=1000, help="malformed: bad requests sent in a row")
    p.add_argument("--turns", type=positive_int, default=8, help="multiturn: turns per conversation")
    p.add_argument("--system-tokens", type=positive_int, default=1500,
                   help="multiturn: the shared system prompt's length (about: 4 characters a token)")
    p.add_argument("--baseline-url", default=None,
                   help="multiturn: the same server without a prefix cache (--prefix-cache-mb 0), to compare")
    p.add_argument("--out", default="serve_load.json", help="where the JSON results go")


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
    import httpx

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

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c, client) for c in range(clients)))
        wall = time.perf_counter() - t0
    return summarize(samples, wall, skipped)


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
    import httpx

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

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)), sampler(client))
        wall = time.perf_counter() - t0
        rss.append((wall, await _server_rss(client, url)))  # after the last requests finished
    return samples, rss, wall


def rss_growth(rss: list[tuple[float, float | None]], warmup: float) -> dict:
    """Memory over a soak, from the first sample at or after ``warmup`` seconds (the baseline): the
    peak growth (largest sample after it / baseline - 1: transient working sets included, e.g. a batch
    of long prompts) and the trend (median of the last third of the samples after the warm-up / median
    of the first third - 1: what a leak shows as). None without samples after the warm-up.
    Example: [(0, 100), (60, 150), (120, 160), (180, 151), (240, 152)], warmup 60 -> baseline 150,
    peak 160 (+6.7%), trend 152 / 150 - 1 (+1.3%)."""
    after = [b for t, b in rss if t >= warmup and b is not None]
    if not after:
        return {"rss_baseline": None, "rss_max_after_warmup": None, "rss_growth": None, "rss_trend": None}
    third = max(1, len(after) // 3)
    return {"rss_baseline": after[0], "rss_max_after_warmup": max(after), "rss_growth": max(after) / after[0] - 1.0,
            "rss_trend": statistics.median(after[-third:]) / statistics.median(after[:third]) - 1.0,
            "rss_first": next((b for _, b in rss if b is not None), None), "rss_last": after[-1]}


def soak_summary(samples: list[Sample], rss: list, wall: float, warmup: float) -> dict:
    """The load's summary (without each answer) and the memory's growth after the warm-up."""
    summary = summarize(samples, wall)
    del summary["samples"]
    return summary | rss_growth(rss, warmup) | {"warmup_s": warmup, "rss": rss}


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
    import httpx

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

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, client) for c in range(clients)))
        wall = time.perf_counter() - t0
    return summarize(samples, wall, skipped) | turn_summary(samples, turns)


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


def summarize(samples: list[Sample], wall: float, skipped: int = 0) -> dict:
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


def compare_conversations(cached: dict | None, baseline: dict | None, temperature: float) -> dict:
    """With the prefix cache against without: tokens/s ratio and (greedy) whether every turn answered the same."""
    if cached is None or baseline is None:
        return {}
    out = {"multiturn_throughput_ratio": cached["tokens_per_s"] / baseline["tokens_per_s"]
           if baseline["tokens_per_s"] else None}
    if temperature == 0:
        out["multiturn_answers_identical"] = same_answers(cached, baseline)
    return out


def same_answers(a: dict, b: dict) -> bool:
    """Every prompt answered the same in both runs (greedy)."""
    first = {}
    for s in a["samples"] + b["samples"]:
        if s["error"] is None and first.setdefault(s["prompt"], s["text"]) != s["text"]:
            return False
    return True


def run(args) -> int:
    questions = load_questions(args.questions)
    bodies = [{"model": args.model, "messages": [{"role": "user", "content": q.turns[0]}], "stream": True,
               "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "seed": 0} for q in questions]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise ValueError(f"--modes takes {', '.join(MODES)}, got {', '.join(sorted(unknown))}")
    total = args.clients * args.requests
    result = {"config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}}
    if "concurrent" in args.modes:
        print(f"concurrent: {args.clients} clients x {args.requests} requests against {args.url} ...")
        result["concurrent"] = asyncio.run(run_load(args.url, bodies, args.clients, args.requests, args.max_seconds))
    if "sequential" in args.modes:
        print(f"sequential: the same {total} requests one at a time ...")
        result["sequential"] = asyncio.run(run_load(args.url, bodies, 1, total, args.max_seconds))
    if "soak" in args.modes:
        print(f"soak: {args.clients} clients for {args.soak_seconds:.0f} s, RSS every {args.sample_every:.0f} s ...")

        def save(samples, rss, elapsed) -> None:  # after every sample: a stopped soak keeps what it measured
            result["soak"] = soak_summary(samples, rss, elapsed, args.warmup_seconds)
            write_json_atomic(args.out, result)

        samples, rss, wall = asyncio.run(run_soak(args.url, bodies, args.clients, args.soak_seconds,
                                                  args.sample_every, save))
        save(samples, rss, wall)
    if "malformed" in args.modes:
        print(f"malformed: {args.malformed} bad requests in a row, then a good one ...")
        result["malformed"] = asyncio.run(run_malformed(args.url, args.model, args.malformed))
    if "multiturn" in args.modes:
        system = system_prompt([q.turns[0] for q in questions], args.system_tokens)
        asks = [q.turns[0] for q in questions]
        for key, url in (("multiturn", args.url), ("multiturn_baseline", args.baseline_url)):
            if url is None:
                continue
            print(f"{key}: {args.clients} conversations x {args.turns} turns against {url} ...")
            result[key] = asyncio.run(run_conversations(url, args.model, system, asks, args.clients, args.turns,
                                                        args.max_tokens, args.temperature, args.max_seconds))
        result |= compare_conversations(result.get("multiturn"), result.get("multiturn_baseline"), args.temperature)
    if "concurrent" in result and "sequential" in result:
        seq = result["sequential"]["tokens_per_s"]
        result["throughput_ratio"] = result["concurrent"]["tokens_per_s"] / seq if seq else None
        if args.temperature == 0:
            result["answers_identical"] = same_answers(result["concurrent"], result["sequential"])
    write_json_atomic(args.out, result)
    if "malformed" in result:
        r = result["malformed"]
        print(f"malformed: {r['requests']} requests in {r['wall_s']:.1f} s, statuses {r['statuses']}; "
              f"then a good request: {'served' if r['then_served'] else 'FAILED: ' + str(r['then_error'])}")
    for key in ("multiturn", "multiturn_baseline"):
        if key in result:
            r = result[key]
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{key:>18}: {r['requests']} turns, {r['errors']} errors, {r['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                  f"first turn {fmt(r['ttft_first_turn_p50_s'])} s, later turns {fmt(r['ttft_later_turns_p50_s'])} s "
                  f"({fmt(r['later_over_first'])}x), {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens cached")
    if "multiturn_throughput_ratio" in result:
        print(f"multiturn with / without the prefix cache, tokens/s: {result['multiturn_throughput_ratio']:.2f}x; "
              f"answers identical: {result.get('multiturn_answers_identical', 'n/a (sampling)')}")
    for mode in ("concurrent", "sequential", "soak"):
        if mode in result:
            r = result[mode]
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{mode:>10}: {r['requests']} requests, {r['errors']} errors, {r['tokens_per_s']:.1f} tokens/s, "
                  f"TTFT p50/p99 {fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])} s, "
                  f"latency p50/p99 {fmt(r['latency_p50_s'])}/{fmt(r['latency_p99_s'])} s")
    if "soak" in result and result["soak"]["rss_growth"] is not None:
        r = result["soak"]
        print(f"soak memory: {r['rss_baseline'] / 2**20:.0f} MB after {r['warmup_s']:.0f} s of warm-up, at most "
              f"{r['rss_max_after_warmup'] / 2**20:.0f} MB after it ({100 * r['rss_growth']:+.1f}%), trend "
              f"{100 * r['rss_trend']:+.1f}% (last third of the samples over the first), {r['rss_last'] / 2**20:.0f} MB at the end")
    elif "soak" in result:
        print(f"soak memory: no {RSS_METRIC} after the warm-up in the server's /metrics")
    if result.get("throughput_ratio") is not None:
        print(f"concurrent / sequential tokens/s: {result['throughput_ratio']:.2f}x; answers identical: "
              f"{result.get('answers_identical', 'n/a (sampling)')}")
    print(f"written to {args.out}")
    failed = any(result[m]["errors"] for m in args.modes if m in result) or \
        ("multiturn_baseline" in result and result["multiturn_baseline"]["errors"])
    return 1 if failed else 0
