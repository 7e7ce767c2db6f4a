"""Does speculation pay at every live batch size of the server? Two servers, one drafter each, the same loads.

    .venv/bin/python scripts/serve_batch_sweep.py --drafters none,auto --clients 1,2,4,8,16 --requests 2 \
        --max-tokens 128 --out results/serve-sweep.json

Starts ``specdec serve --drafter D --no-suffix-cache --max-batch 16`` once per drafter (each on its own
port; an idle server waits without using the CPU), then for each client count C sends C concurrent
clients x ``--requests`` greedy requests (``specdec.bench.serve_load.run_load``) to each server in turn,
the order alternating from one C to the next, ``--rounds`` times. With C clients the live batch is
about C. Prints each drafter's total tokens/s per C and its ratio to the first drafter's (medians over
the rounds), and whether the answers were identical; the JSON is rewritten after every load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx

from specdec.arguments import name_list, positive_int
from specdec.bench.questions import load_questions
from specdec.bench.serve_load import same_answers, run_load
from specdec.jsonl import write_json_atomic


def start(drafter: str, port: int, model: str, weights: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", model, "--weights", weights, "--drafter", drafter,
           "--no-suffix-cache", "--max-batch", "16", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"`{' '.join(cmd)}` did not answer /health within 600 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--weights", default="fp32", help="the servers' --weights (fp32: docs/benchmarks.md's sweeps)")
    p.add_argument("--drafters", type=name_list, default=["none", "auto"], help="the first is the baseline")
    p.add_argument("--clients", type=name_list, default=["1", "2", "4", "8", "16"])
    p.add_argument("--requests", type=positive_int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--rounds", type=positive_int, default=1)
    p.add_argument("--port", type=positive_int, default=8790, help="the first server's port (then +1, ...)")
    p.add_argument("--out", default="serve-sweep.json")
    args = p.parse_args()
    bodies = [{"model": "default", "messages": [{"role": "user", "content": q.turns[0]}], "stream": True,
               "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens, "temperature": 0}
              for q in load_questions(None)]
    servers = {d: start(d, args.port + i, args.model, args.weights) for i, d in enumerate(args.drafters)}
    result = {"config": vars(args), "loads": []}
    try:
        for r in range(args.rounds):
            for i, c in enumerate(int(c) for c in args.clients):
                order = args.drafters if (i + r) % 2 == 0 else args.drafters[::-1]
                runs = {}
                for d in order:
                    url = f"http://127.0.0.1:{args.port + args.drafters.index(d)}"
                    runs[d] = asyncio.run(run_load(url, bodies, c, args.requests, 1800))
                    print(f"round {r} clients {c:>2} {d:>12}: {runs[d]['tokens_per_s']:.1f} tokens/s, "
                          f"{runs[d]['errors']} errors", flush=True)
                base = runs[args.drafters[0]]
                result["loads"].append({"round": r, "clients": c, "identical": all(same_answers(base, x) for x in runs.values()),
                                        **{d: {k: v for k, v in x.items() if k != "samples"} for d, x in runs.items()}})
                write_json_atomic(args.out, result)
    finally:
        for proc in servers.values():
            proc.terminate()
    print(f"\n{'clients':>8} " + " ".join(f"{d:>18}" for d in args.drafters) + "  identical")
    for c in (int(c) for c in args.clients):
        loads = [x for x in result["loads"] if x["clients"] == c]
        med = {d: statistics.median(x[d]["tokens_per_s"] for x in loads) for d in args.drafters}
        base = med[args.drafters[0]]
        cells = " ".join(f"{med[d]:8.1f} ({med[d] / base:.2f}x)" for d in args.drafters)
        print(f"{c:>8} {cells}  {all(x['identical'] for x in loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
