"""How long the commands take to start, each from a fresh process (issue 63, part 3).

    .venv/bin/python scripts/startup_times.py --runs 5 --out results/startup.json
    .venv/bin/python scripts/startup_times.py --runs 5 --checkout /tmp/before    # another checkout's code

Three figures per run, the kinds in turn within each run (so a busy spell hits all of them):

- ``generate``: wall seconds of the README's command (``specdec generate "Summarize: ..." --drafter
  prompt-lookup``), from the process's start to its exit;
- ``chat``: seconds from ``specdec chat``'s start to the first character of its reply to a question that
  waits on its stdin from the start (then ``/quit``); ``chat-auto`` the same with ``--drafter auto``;
- ``serve``: seconds from ``specdec serve``'s start to the end of its first answer (a greedy chat
  completion of 16 tokens, asked every 50 ms until the server takes it), and to the first token of a
  streamed one sent just after.

Warm caches are assumed: run the command once before (the default model's conversion, the kernel
build, the self-checks' kept verdicts). ``--checkout DIR`` runs another checkout's ``specdec`` package
with this interpreter (``PYTHONPATH=DIR``), to compare before and after a change on the same machine.
Prints the median and the fastest of each; the JSON holds every run and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Summarize: the meeting moved from Monday to Tuesday, and the room moved from A to B."


def _env(checkout: str | None) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if checkout:
        env["PYTHONPATH"] = checkout + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cwd(checkout: str | None) -> str | None:
    """``python -m`` puts the working directory first on sys.path: run another checkout's code from inside it."""
    return checkout


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec.cli", *args]


def generate_seconds(checkout: str | None) -> float:
    t = time.perf_counter()
    subprocess.run(_command("generate", PROMPT, "--drafter", "prompt-lookup"), env=_env(checkout),
                   cwd=_cwd(checkout), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def chat_seconds(checkout: str | None, drafter: str = "prompt-lookup") -> float:
    """Start to the first character after the reply's "model> " (the question is on stdin from the start)."""
    t = time.perf_counter()
    p = subprocess.Popen(_command("chat", "--no-color", "--max-new-tokens", "32", "--drafter", drafter),
                         env=_env(checkout),
                         cwd=_cwd(checkout), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdin.write(f"{PROMPT}\n/quit\n".encode())
    p.stdin.close()
    seen, first = b"", None
    while first is None:
        byte = p.stdout.read(1)
        if not byte:
            break
        seen += byte
        if b"model> " in seen and not byte.isspace() and seen.rindex(b"model> ") + 7 < len(seen):
            first = time.perf_counter() - t
    p.stdout.read()
    p.wait()
    if first is None:
        raise RuntimeError(f"chat gave no reply: {seen[-300:]!r}")
    return first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_seconds(checkout: str | None) -> tuple[float, float]:
    """(start to the first answer's end, start to a second, streamed answer's first token)."""
    import httpx

    port = _free_port()
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
            "temperature": 0}
    t = time.perf_counter()
    p = subprocess.Popen(_command("serve", "--port", str(port), "--no-suffix-cache"), env=_env(checkout),
                         cwd=_cwd(checkout), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"specdec serve exited with {p.returncode}")
            try:
                httpx.post(url, json=body, timeout=60).raise_for_status()
                answered = time.perf_counter() - t
                break
            except httpx.TransportError:
                time.sleep(0.05)
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                    break
        return answered, time.perf_counter() - t
    finally:
        p.terminate()
        p.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--checkout", default=None, help="a checkout whose specdec package to run (PYTHONPATH)")
    ap.add_argument("--kinds", default="generate,chat,serve", help="of generate, chat, chat-auto (--drafter auto), serve")
    ap.add_argument("--out", default=None, help="a JSON file for every run's figures")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    if "serve" in kinds:
        runs["serve_stream_first_token"] = []
    for i in range(args.runs):
        for kind in kinds:
            if kind == "generate":
                runs[kind].append(generate_seconds(args.checkout))
            elif kind == "chat":
                runs[kind].append(chat_seconds(args.checkout))
            elif kind == "chat-auto":
                runs[kind].append(chat_seconds(args.checkout, "auto"))
            else:
                answered, streamed = serve_seconds(args.checkout)
                runs[kind].append(answered)
                runs["serve_stream_first_token"].append(streamed)
        print(f"run {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
    for k, v in runs.items():
        print(f"{k:26s} median {statistics.median(v):.2f} s   fastest {min(v):.2f} s   ({len(v)} runs)")
    if args.out:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "checkout": args.checkout,
                                              "load_average": os.getloadavg(), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
