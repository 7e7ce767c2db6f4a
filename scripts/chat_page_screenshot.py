"""The README's picture of the chat page (docs/chat-page.png): `specdec serve` on the default model,
questions asked greedily in headless Chromium (Debian's chromium and chromium-driver, as the tests
use), the page photographed once the answers, and the panel's charts of them, are in.

    .venv/bin/python scripts/chat_page_screenshot.py --out docs/chat-page.png
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from browser_helpers import launch, missing  # noqa: E402

QUESTIONS = (
    "Put these in alphabetical order, one per line: pear, apple, fig, banana, cherry, grape, kiwi, mango.",
    "Summarize: the meeting moved from Monday to Tuesday, and the room moved from A to B.",
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "chat-page.png"))
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--pause", type=float, default=12.0, help="seconds between questions (the charts show each)")
    args = p.parse_args()
    if (reason := missing()) is not None:
        raise SystemExit(f"no browser: {reason}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", args.model, "--drafter",
                                   args.drafter, "--port", str(port), "--cache-dir", folder],
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
        driver = None
        try:
            while True:
                assert server.poll() is None, "the server exited"
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            driver = launch(Path(folder) / "profile", 1280, 860)
            driver.get(url + "/")
            time.sleep(1)
            for name, value in (("temperature", "0"), ("max_tokens", "120")):
                field = driver.find_element("id", name)
                field.clear()
                field.send_keys(value)
            for question in QUESTIONS:
                driver.find_element("id", "input").send_keys(question)
                driver.find_element("id", "send").click()
                time.sleep(0.5)
                while driver.execute_script("return !!document.querySelector('.msg.assistant[data-state=streaming]')"):
                    time.sleep(0.2)
                time.sleep(args.pause)
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}")
        finally:
            if driver is not None:
                driver.quit()
            server.terminate()
            server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
