"""Drive the dashboard (``/dashboard``) in a headless Chromium, and take the screenshot the docs
show (docs/img/dashboard.png):

    python -m pagoda.tools.dashboard_screenshot --out docs/img/dashboard.png

Without ``--url`` it starts ``pagoda serve`` (the built-in demo model, ``--api-key`` set, the
priority policy) on a free loopback port, sends a workload of prompts sharing a system prompt,
and takes the picture while requests run; with ``--url`` it photographs that server as it is.
Needs Playwright (``pip install playwright``) and a Chromium on this machine (Debian:
``apt-get install chromium``); Playwright's own browser download is not used. The tests drive the
page with ``DashboardBrowser`` from here.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

CHROMIUM_ENV = "PAGODA_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SYSTEM_PROMPT = "You are a helpful assistant of the pagoda inference server. Answer in short sentences. "
QUESTIONS = ("What is a paged KV cache?", "Why share prompt prefixes?", "How does continuous batching work?",
             "What is a radix tree?", "Why chunk long prompts?", "What does the scheduler do?")


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable: ``$PAGODA_CHROMIUM`` where that is a file, else the
    first on ``PATH``; None when there is none."""
    named = os.environ.get(CHROMIUM_ENV)
    if named and Path(named).is_file():
        return named
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class DashboardBrowser:
    """A headless Chromium on the dashboard of ``base_url``; logs in with ``api_key`` when the
    page asks for it. ``value(id)`` reads a card's number (its ``data-value``)."""

    def __init__(self, base_url: str, api_key: str | None = None, executable: str | None = None,
                 viewport: tuple[int, int] = (1400, 1300)) -> None:
        from playwright.sync_api import sync_playwright

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        executable = executable or find_chromium()
        if executable is None:
            raise RuntimeError(f"no Chromium found: install it (apt-get install chromium) or set {CHROMIUM_ENV}")
        self._playwright = sync_playwright().start()
        try:
            # --no-sandbox: Chromium refuses its sandbox as root (containers, CI).
            self.browser = self._playwright.chromium.launch(executable_path=executable, headless=True,
                                                            args=["--no-sandbox"])
            self.page = self.browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        except BaseException:
            self._playwright.stop()
            raise

    def __enter__(self) -> "DashboardBrowser":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.browser.close()
        finally:
            self._playwright.stop()

    def open(self, timeout_s: float = 30.0) -> bool:
        """Load the page, answer its key form if shown, and wait for its first render; whether
        the page asked for the key."""
        self.page.goto(self.base_url + "/dashboard")
        self.page.wait_for_function("() => !document.getElementById('login').hidden || "
                                    "Number(document.body.dataset.updates || 0) > 0", timeout=timeout_s * 1000)
        if self.page.is_visible("#login"):
            if self.api_key is None:
                raise RuntimeError("the dashboard asks for an API key and none was given")
            asked = True
            self.page.fill("#key", self.api_key)
            self.page.click("#login button[type=submit]")
        else:
            asked = False
        self.wait_updates(1, timeout_s)
        return asked

    def updates(self) -> int:
        return int(self.page.evaluate("() => Number(document.body.dataset.updates || 0)"))

    def wait_updates(self, count: int, timeout_s: float = 30.0) -> None:
        """Wait until the page has drawn ``count`` snapshots in all."""
        self.page.wait_for_function(f"() => Number(document.body.dataset.updates || 0) >= {count}",
                                    timeout=timeout_s * 1000)

    def value(self, element_id: str) -> int:
        return int(self.page.get_attribute(f"#{element_id}", "data-value"))

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=True)


# ---- the stand-alone picture -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(base_url: str, api_key: str | None, body: dict[str, Any]) -> None:
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def _workload(base_url: str, api_key: str | None, stop: threading.Event, worker: int) -> None:
    """Prompts sharing the system prompt (the hot prefix), in three priority classes."""
    i = worker
    while not stop.is_set():
        body = {"prompt": SYSTEM_PROMPT + QUESTIONS[i % len(QUESTIONS)], "max_tokens": 48 + 16 * (i % 4),
                "ignore_eos": True, "priority": i % 3}
        try:
            _post(base_url, api_key, body)
        except OSError:
            return
        i += 1


def _start_server(port: int, api_key: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port), "--api-key", api_key,
           "--scheduling-policy", "priority", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s")


def take(out: Path, url: str | None, api_key: str | None, warm_s: float) -> None:
    """Photograph ``url``'s dashboard, or a demo server's under load (``url`` None)."""
    if url is not None:
        with DashboardBrowser(url, api_key) as browser:
            browser.open()
            browser.wait_updates(3)
            browser.screenshot(out)
        return
    api_key = api_key or secrets.token_urlsafe(16)
    base_url = f"http://127.0.0.1:{_free_port()}"
    proc = _start_server(int(base_url.rsplit(":", 1)[1]), api_key)
    stop = threading.Event()
    try:
        _wait_healthy(base_url, proc)
        workers = [threading.Thread(target=_workload, args=(base_url, api_key, stop, w), daemon=True)
                   for w in range(6)]
        for w in workers:
            w.start()
        with DashboardBrowser(base_url, api_key) as browser:
            browser.open()
            time.sleep(warm_s)  # minutes of history make the charts worth a look
            browser.page.wait_for_function("() => Number(document.getElementById('running').dataset.value) > 0",
                                           timeout=60_000)
            browser.wait_updates(browser.updates() + 1)
            browser.screenshot(out)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.tools.dashboard_screenshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--url", help="an already running server (default: start the demo model under load)")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"))
    parser.add_argument("--warm", type=float, default=40.0, help="seconds of load before the picture (demo server)")
    args = parser.parse_args(argv)
    take(args.out, args.url, args.api_key, args.warm)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
