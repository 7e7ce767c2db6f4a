"""Headless Chromium for the chat page's tests: Debian's ``chromium`` and ``chromium-driver`` driven by
selenium (the ``test`` extra). Nothing is downloaded: the browser and its driver are the system's.

Where they are missing the browser tests skip, saying what to install; with
``SPECDEC_BROWSER_TESTS=required`` (CI, .ci/run) they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

BROWSERS = ("chromium", "chromium-browser")  # Debian's package, and its name elsewhere
DRIVER = "chromedriver"  # Debian's chromium-driver
INSTALL = ("apt-get install -y chromium chromium-driver (Debian), and selenium (pip install -e '.[test]')")
# the network is closed: without these chromium waits on refused connections (its own updates, sync,
# field trials, QUIC probes) and a first-run dialog; --no-sandbox: CI runs as root
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--no-default-browser-check", "--mute-audio")


def missing() -> str | None:
    """What the browser tests lack on this machine (None: nothing)."""
    try:
        import selenium  # noqa: F401
    except ModuleNotFoundError:
        return "the Python package selenium is not installed"
    if not any(shutil.which(b) for b in BROWSERS):
        return "no chromium on PATH"
    if not shutil.which(DRIVER):
        return "no chromedriver on PATH (Debian's chromium-driver)"
    return None


def require_browser() -> None:
    """Skip (a developer's machine) or fail (``SPECDEC_BROWSER_TESTS=required``) without a browser."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("SPECDEC_BROWSER_TESTS") == "required":
        pytest.fail(f"browser tests required (SPECDEC_BROWSER_TESTS=required) but {reason}: {INSTALL}")
    pytest.skip(f"browser tests skipped: {reason}; to run them: {INSTALL}")


def launch(profile, width: int = 1280, height: int = 900):
    """A headless Chromium with a fresh profile folder ``profile``, logging the page's network events
    (``requested_urls``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # the system's driver, named: selenium then never looks for (or downloads) one of its own
    return webdriver.Chrome(service=Service(shutil.which(DRIVER)), options=options)


def requested_urls(driver) -> list[str]:
    """Every URL the page asked for since the last call (the DevTools log of network requests: loads,
    fetches, and any that failed or were blocked)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls
