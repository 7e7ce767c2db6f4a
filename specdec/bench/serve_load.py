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
import statistics

from specdec.arguments import name_list, non_negative_float, positive_int
from specdec.bench.questions import load_questions
# the load generator; its names stay importable from here (tests, scripts/serve_batch_sweep.py)
from specdec.bench.serve_client import (RSS_METRIC, Sample, malformed_bodies, percentile,  # noqa: F401
                                        run_conversations, run_load, run_malformed, run_soak, summarize,
                                        system_prompt, turn_summary)
from specdec.jsonl import write_json_atomic

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


def _compare_load(result: dict, temperature: float) -> dict:
    """Concurrent against sequential: tokens/s ratio and (greedy) whether every answer is the same."""
    if "concurrent" not in result or "sequential" not in result:
        return {}
    seq = result["sequential"]["tokens_per_s"]
    out = {"throughput_ratio": result["concurrent"]["tokens_per_s"] / seq if seq else None}
    if temperature == 0:
        out["answers_identical"] = same_answers(result["concurrent"], result["sequential"])
    return out


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
        _soak(args, bodies, result)
    if "malformed" in args.modes:
        print(f"malformed: {args.malformed} bad requests in a row, then a good one ...")
        result["malformed"] = asyncio.run(run_malformed(args.url, args.model, args.malformed))
    if "multiturn" in args.modes:
        result |= _multiturn(args, [q.turns[0] for q in questions])
    result |= _compare_load(result, args.temperature)
    write_json_atomic(args.out, result)
    _print_report(result, args.out)
    failed = any(result[m]["errors"] for m in args.modes if m in result) or \
        ("multiturn_baseline" in result and result["multiturn_baseline"]["errors"])
    return 1 if failed else 0


def _soak(args, bodies: list[dict], result: dict) -> None:
    """The soak into ``result["soak"]``, ``result`` written to ``args.out`` after every RSS sample."""
    print(f"soak: {args.clients} clients for {args.soak_seconds:.0f} s, RSS every {args.sample_every:.0f} s ...")

    def save(samples, rss, elapsed) -> None:  # after every sample: a stopped soak keeps what it measured
        result["soak"] = soak_summary(samples, rss, elapsed, args.warmup_seconds)
        write_json_atomic(args.out, result)

    samples, rss, wall = asyncio.run(run_soak(args.url, bodies, args.clients, args.soak_seconds,
                                              args.sample_every, save))
    save(samples, rss, wall)


def _multiturn(args, texts: list[str]) -> dict:
    """The conversations against ``args.url`` (and ``args.baseline_url``, if given) and their comparison."""
    system = system_prompt(texts, args.system_tokens)
    out = {}
    for key, url in (("multiturn", args.url), ("multiturn_baseline", args.baseline_url)):
        if url is None:
            continue
        print(f"{key}: {args.clients} conversations x {args.turns} turns against {url} ...")
        out[key] = asyncio.run(run_conversations(url, args.model, system, texts, args.clients, args.turns,
                                                 args.max_tokens, args.temperature, args.max_seconds))
    return out | compare_conversations(out.get("multiturn"), out.get("multiturn_baseline"), args.temperature)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print_report(result: dict, out: str) -> None:
    """One line per mode run, and the comparisons between them."""
    if "malformed" in result:
        r = result["malformed"]
        print(f"malformed: {r['requests']} requests in {r['wall_s']:.1f} s, statuses {r['statuses']}; "
              f"then a good request: {'served' if r['then_served'] else 'FAILED: ' + str(r['then_error'])}")
    for key in ("multiturn", "multiturn_baseline"):
        if key in result:
            r = result[key]
            print(f"{key:>18}: {r['requests']} turns, {r['errors']} errors, {r['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                  f"first turn {_fmt(r['ttft_first_turn_p50_s'])} s, later turns {_fmt(r['ttft_later_turns_p50_s'])} s "
                  f"({_fmt(r['later_over_first'])}x), "
                  f"{r['cached_tokens']} of {r['prompt_tokens']} prompt tokens cached")
    if "multiturn_throughput_ratio" in result:
        print(f"multiturn with / without the prefix cache, tokens/s: {result['multiturn_throughput_ratio']:.2f}x; "
              f"answers identical: {result.get('multiturn_answers_identical', 'n/a (sampling)')}")
    for mode in ("concurrent", "sequential", "soak"):
        if mode in result:
            r = result[mode]
            print(f"{mode:>10}: {r['requests']} requests, {r['errors']} errors, {r['tokens_per_s']:.1f} tokens/s, "
                  f"TTFT p50/p99 {_fmt(r['ttft_p50_s'])}/{_fmt(r['ttft_p99_s'])} s, "
                  f"latency p50/p99 {_fmt(r['latency_p50_s'])}/{_fmt(r['latency_p99_s'])} s")
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
    print(f"written to {out}")
