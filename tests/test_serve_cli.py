"""`specdec serve` as a process: it starts, answers, stops on SIGTERM / SIGINT saving its suffix cache,
and after a restart answers the same question identically, drafting from what it served before."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tiny_chat import save_tiny_chat

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, cache: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "SPECDEC_KERNEL": "off",
           "SPECDEC_KERNEL_CALIBRATE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", str(model), "--drafter", "suffix",
                             "--port", str(port), "--cache-dir", str(cache), "--model-name", "tiny"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, f"the server exited: {proc.stdout.read()}"
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


def _ask(port: int) -> tuple[str, float]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "say it again and again"}],
            "temperature": 0, "max_tokens": 48}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith('specdec_accepted_tokens_total{drafter="SuffixDrafter"}')]
    return r.json()["choices"][0]["message"]["content"], sum(accepted)


def _stop(proc: subprocess.Popen, sig) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    # uvicorn re-raises SIGTERM after its graceful shutdown (the conventional exit by that signal)
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out, out
    return out


@pytest.mark.timeout(300)
def test_serve_restarts_with_its_suffix_cache(tmp_path):
    save_tiny_chat(tmp_path / "tiny")
    cache, port = tmp_path / "cache", _port()
    proc = _start(tmp_path / "tiny", cache, port)
    try:
        first, _ = _ask(port)
    finally:
        out = _stop(proc, signal.SIGTERM)
    assert (cache / "suffix-cache.json").is_file(), out
    proc = _start(tmp_path / "tiny", cache, port)
    try:
        again, accepted = _ask(port)
    finally:
        out = _stop(proc, signal.SIGINT)
    assert again == first
    assert accepted > 0, out  # drafted from the answer served before the restart
    assert "1 answers loaded" in out


def test_the_hardening_options_reach_the_server_and_uvicorn(tmp_path):
    """--api-key-file's first line is the key; --max-body-bytes, --request-timeout go to the app,
    --max-connections to uvicorn's limit_concurrency (by default the batch, the queue and 32 more)."""
    from specdec.cli import build_parser
    from specdec.cli.serve import serve_config, uvicorn_options

    key = tmp_path / "key"
    key.write_text("s3cret \nignored\n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(key), "--max-body-bytes", "1000",
                                      "--request-timeout", "2.5", "--max-batch", "4", "--max-queue", "10"])
    config = serve_config(args)
    assert (config.api_key, config.max_body_bytes, config.request_timeout) == ("s3cret", 1000, 2.5)
    assert "s3cret" not in repr(config)
    assert uvicorn_options(args)["limit_concurrency"] == 4 + 10 + 32
    args = build_parser().parse_args(["serve", "--api-key", "k", "--max-connections", "5"])
    assert serve_config(args).api_key == "k" and serve_config(args).request_timeout == 0
    assert uvicorn_options(args)["limit_concurrency"] == 5 and serve_config(args).max_body_bytes == 8 * 2**20
    assert serve_config(build_parser().parse_args(["serve"])).api_key is None
    key.write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        serve_config(build_parser().parse_args(["serve", "--api-key-file", str(key)]))
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["serve", "--api-key", "k", "--api-key-file", str(key)])
