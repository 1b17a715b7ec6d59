"""The dashboard against a live ``pagoda serve --api-key``: the snapshot's numbers move while a
workload runs and add up to what the responses say afterwards; the key guards the snapshot but
not the page; hot prefixes show text only when unsalted; ``pagoda top --once`` prints the same
snapshot; and the page itself, in a real headless Chromium, renders and counts the requests.

The browser test skips only where no Chromium executable exists (``apt-get install chromium``;
CI installs it in .ci/run); Playwright comes with the test extra."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from pagoda.entrypoints.openai.dashboard.history import DashboardHistory
from pagoda.entrypoints.openai.dashboard.routes import Dashboard
from pagoda.tools.dashboard_screenshot import DashboardBrowser, find_chromium
from server_helpers import MAX_MODEL_LEN, ServerProcess, free_port, start_server

MODEL = "tiny"
KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough that a snapshot catches the requests running on a fast machine too.
MAX_TOKENS = MAX_MODEL_LEN - 40
# Run one at a time (the server's --max-num-seqs 1), 24 x 472 tokens outlast several snapshots (fresh
# at most every 0.5 s) and the page's one-second polls on a fast machine (this tiny model decodes a
# sequence in well under a millisecond a token there).
LOAD_REQUESTS = 24

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One sequence at a time: a workload of LOAD_REQUESTS takes that many requests' decoding one after
    # another, so even on a fast machine it spans many fresh snapshots and page polls.
    srv = start_server(llama_dir, tmp_path_factory.mktemp("dashboard-logs"), "--served-model-name", MODEL,
                       "--api-key", KEY, "--max-num-seqs", "1")
    yield srv
    srv.stop()


def state(base_url: str) -> dict[str, Any]:
    resp = httpx.get(base_url + "/dashboard/api/state", headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete(base_url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}
    resp = httpx.post(base_url + "/v1/completions", json=body, headers=AUTH, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


class Load:
    """``n`` long completions on threads; ``usages`` their usage once joined."""

    def __init__(self, base_url: str, n: int, max_tokens: int = MAX_TOKENS) -> None:
        self.usages: list[dict[str, Any]] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(base_url, [5 + i, 6, 7, 8, 9 + i], max_tokens))
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, base_url: str, prompt: list[int], max_tokens: int) -> None:
        try:
            self.usages.append(complete(base_url, prompt, max_tokens))
        except BaseException as exc:  # reported by join
            self.errors.append(exc)

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self) -> list[dict[str, Any]]:
        for t in self.threads:
            t.join(300)
        assert not self.errors, self.errors
        return self.usages


def test_page_is_open_and_the_snapshot_needs_the_key(server: ServerProcess) -> None:
    page = httpx.get(server.base_url + "/dashboard", timeout=30)
    assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
    script = httpx.get(server.base_url + "/dashboard/static/dashboard.js", timeout=30)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "Authorization" in script.text  # the key goes as a bearer header, never in a URL
    for missing in ("/dashboard/static/nothing.js", "/dashboard/static/..%2F__init__.py"):
        assert httpx.get(server.base_url + missing, timeout=30).status_code == 404
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(server.base_url + "/dashboard/api/state", headers=headers, timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert state(server.base_url)["server"]["model"] == MODEL
    named = httpx.get(server.base_url + "/dashboard/api/state", params={"model": MODEL}, headers=AUTH, timeout=30)
    assert named.status_code == 200 and named.json()["server"]["model"] == MODEL  # as on a server of several
    other = httpx.get(server.base_url + "/dashboard/api/state", params={"model": "other"}, headers=AUTH, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_snapshot_numbers_move_with_a_workload(server: ServerProcess) -> None:
    base = state(server.base_url)
    load = Load(server.base_url, LOAD_REQUESTS)
    seen: dict[str, int] = {}  # request id -> fewest output tokens a snapshot showed it with
    busy = False
    while load.running():
        snap = state(server.base_url)["engine"]
        if snap["num_running"] > 0 and snap["num_used_blocks"] > 0 and snap["kv_cache_usage"] > 0:
            busy = True
        for req in snap["requests"]:
            assert req["num_prompt_tokens"] == 5 and req["age_s"] >= 0
            seen[req["request_id"]] = min(seen.get(req["request_id"], MAX_TOKENS), req["num_output_tokens"])
        time.sleep(0.2)
    usages = load.join()
    assert busy, "no snapshot saw the requests running with KV blocks in use"
    # A snapshot caught a request part-way: fewer output tokens than it finished with (each ends with
    # MAX_TOKENS), so the numbers it showed were live ones.
    assert seen and min(seen.values()) < MAX_TOKENS, seen
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
    after = state(server.base_url)
    deadline = time.monotonic() + 30
    while after["engine"]["num_running"] and time.monotonic() < deadline:  # a snapshot from before the end
        time.sleep(0.2)
        after = state(server.base_url)
    c0, c1 = base["counters"], after["counters"]
    assert c1["finished"] - c0["finished"] == LOAD_REQUESTS
    assert c1["generation_tokens"] - c0["generation_tokens"] == sum(u["completion_tokens"] for u in usages)
    assert c1["prompt_tokens"] - c0["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert after["engine"]["num_running"] == 0 and after["engine"]["num_used_blocks"] == 0
    assert after["finished_by_priority"]["0"]["finished"] >= LOAD_REQUESTS
    # The history's intervals hold every token of the run (the server is younger than the ring).
    hist = after["history"]
    assert after["server"]["uptime_s"] < 500
    assert sum(s["generation_tps"] * s["dt"] for s in hist) == pytest.approx(c1["generation_tokens"], rel=1e-6)
    assert any(s["itl_mean"] is not None for s in hist) and any(s["ttft_mean"] is not None for s in hist)


def test_hot_prefixes_show_text_only_unsalted(server: ServerProcess) -> None:
    shared = list(range(300, 340))  # 40 tokens: two full blocks of 16 are cached
    secret = list(range(400, 440))
    for _ in range(3):
        complete(server.base_url, shared, 2)
        complete(server.base_url, secret, 2, cache_salt="tenant-secret")
    text = httpx.post(server.base_url + "/detokenize", json={"model": MODEL, "tokens": shared[:32]}, headers=AUTH,
                      timeout=30).json()["prompt"]
    # Viewers share a snapshot for up to 0.5 s: poll until one taken after these requests shows them.
    deadline = time.monotonic() + 60
    while True:
        prefixes = state(server.base_url)["engine"]["prefixes"]
        public = [p for p in prefixes if p["preview"] == text]
        if (public and any(p["salted"] for p in prefixes)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert public and public[0]["num_tokens"] == 32 and public[0]["hits"] >= 2 and not public[0]["salted"]
    private = [p for p in prefixes if p["salted"]]
    assert private and private[0]["num_tokens"] == 32 and private[0]["preview"] is None
    assert len(private[0]["hash"]) == 16


def test_tenant_isolation_hides_every_preview() -> None:
    class Engine:
        engine_pid = 1

        def detokenize(self, ids: list[int]) -> str:
            return "text"

    shown = Dashboard(Engine(), MODEL, DashboardHistory())  # type: ignore[arg-type]
    hidden = Dashboard(Engine(), MODEL, DashboardHistory(), hide_text=True)  # type: ignore[arg-type]
    prefix = {"hash": "ab", "num_tokens": 16, "hits": 2, "salted": False, "preview_token_ids": [1, 2]}
    assert shown._prefix(dict(prefix))["preview"] == "text"
    assert hidden._prefix(dict(prefix))["preview"] is None
    assert "preview_token_ids" not in hidden._prefix(dict(prefix))


def top(*args: str, module: str = "pagoda.entrypoints.top") -> subprocess.CompletedProcess:
    """``pagoda top ARGS``; by default through its own module (the whole CLI loads torch: slow)."""
    command = [sys.executable, "-m", module] + (["top"] if module == "pagoda.entrypoints.cli" else [])
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=120)


def test_pagoda_top_once(server: ServerProcess) -> None:
    finished = state(server.base_url)["counters"]["finished"]
    out = top("--url", server.base_url, "--api-key", KEY, "--once", module="pagoda.entrypoints.cli")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"pagoda top - {MODEL} - cpu")
    assert f"finished {finished} " in out.stdout and "\x1b[" not in out.stdout
    assert "HOT PREFIX" in out.stdout and "KV cache" in out.stdout
    refused = top("--url", server.base_url, "--once")
    assert refused.returncode == 2 and "API key" in refused.stderr
    gone = top("--url", f"http://127.0.0.1:{free_port()}", "--api-key", KEY, "--once")
    assert gone.returncode == 1 and "cannot read" in gone.stderr


def test_dashboard_in_headless_chromium(server: ServerProcess, tmp_path: Path) -> None:
    if find_chromium() is None:
        pytest.skip("no Chromium executable (apt-get install chromium, or set PAGODA_CHROMIUM)")
    with DashboardBrowser(server.base_url, KEY) as browser:
        assert browser.open()  # the page asked for the key (its data needs it) and got it in its form
        assert browser.page.is_hidden("#login") and browser.page.is_visible("#main")
        finished = browser.value("finished")
        assert finished == state(server.base_url)["counters"]["finished"]
        load = Load(server.base_url, LOAD_REQUESTS)
        browser.page.wait_for_function(
            "() => Number(document.getElementById('running').dataset.value) > 0 && "
            "document.querySelectorAll('#requests tbody tr').length > 0", timeout=120_000)
        load.join()
        browser.page.wait_for_function(
            f"() => Number(document.getElementById('finished').dataset.value) >= {finished + LOAD_REQUESTS}",
            timeout=60_000)
        assert browser.value("finished") == finished + LOAD_REQUESTS
        shot = tmp_path / "dashboard.png"
        browser.screenshot(shot)
        assert shot.stat().st_size > 10_000
