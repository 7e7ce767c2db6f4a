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
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass

from specdec.arguments import name_list, non_negative_float, positive_int
from specdec.bench.questions import load_questions


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
                   help="concurrent, sequential or both (in that order). The server remembers what it served "
                        "(suffix cache): compare the modes on servers started with --no-suffix-cache, or one "
                        "mode per fresh server")
    p.add_argument("--out", default="serve_load.json", help="where the JSON results go")


@dataclass(frozen=True)
class Sample:
    prompt: int  # index into the prompts
    ttft: float | None  # seconds to the first content token (None: failed)
    latency: float | None  # seconds to the end of the answer
    tokens: int  # completion tokens (usage)
    text: str
    error: str | None = None


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile: q in [0, 100]. Example: [1, 2, 3, 4], 50 -> 2; 99 -> 4."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def _one(client, url: str, body: dict, index: int) -> Sample:
    t0 = time.perf_counter()
    ttft, parts, tokens = None, [], 0
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
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
    except Exception as e:  # noqa: BLE001 -- a failed request is a data point
        return Sample(index, None, None, 0, "", f"{type(e).__name__}: {e}")
    # a server that sends no usage (another implementation): its content chunks, about one token each
    tokens = tokens or sum(1 for p in parts if p)
    return Sample(index, ttft, time.perf_counter() - t0, tokens, "".join(parts))


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


def _same_answers(a: dict, b: dict) -> bool:
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
    unknown = set(args.modes) - {"concurrent", "sequential"}
    if unknown:
        raise ValueError(f"--modes takes concurrent and sequential, got {', '.join(sorted(unknown))}")
    total = args.clients * args.requests
    result = {"config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}}
    if "concurrent" in args.modes:
        print(f"concurrent: {args.clients} clients x {args.requests} requests against {args.url} ...")
        result["concurrent"] = asyncio.run(run_load(args.url, bodies, args.clients, args.requests, args.max_seconds))
    if "sequential" in args.modes:
        print(f"sequential: the same {total} requests one at a time ...")
        result["sequential"] = asyncio.run(run_load(args.url, bodies, 1, total, args.max_seconds))
    if "concurrent" in result and "sequential" in result:
        seq = result["sequential"]["tokens_per_s"]
        result["throughput_ratio"] = result["concurrent"]["tokens_per_s"] / seq if seq else None
        if args.temperature == 0:
            result["answers_identical"] = _same_answers(result["concurrent"], result["sequential"])
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    for mode in ("concurrent", "sequential"):
        if mode in result:
            r = result[mode]
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{mode:>10}: {r['requests']} requests, {r['errors']} errors, {r['tokens_per_s']:.1f} tokens/s, "
                  f"TTFT p50/p99 {fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])} s, "
                  f"latency p50/p99 {fmt(r['latency_p50_s'])}/{fmt(r['latency_p99_s'])} s")
    if result.get("throughput_ratio") is not None:
        print(f"concurrent / sequential tokens/s: {result['throughput_ratio']:.2f}x; answers identical: "
              f"{result.get('answers_identical', 'n/a (sampling)')}")
    print(f"written to {args.out}")
    return 0 if all(result[m]["errors"] == 0 for m in args.modes) else 1
