"""The sleep-mode routes of ``pagoda serve --enable-sleep-mode`` (behind the API key): a request
sent while asleep waits and completes after /wake_up with the same greedy output; a bad level
is a 400; /reset_prefix_cache empties the cache; /update_weights serves another checkpoint."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.entrypoints.server_helpers import ServerProcess, start_server

KEY = "sleepy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(llama_dir, tmp_path_factory.mktemp("sleep-logs"), "--enable-sleep-mode", "--api-key", KEY)
    yield srv
    srv.stop()


def complete(server: ServerProcess, body: dict = BODY) -> list[int] | str:
    r = httpx.post(server.base_url + "/v1/completions", headers=AUTH, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def post(server: ServerProcess, path: str, **kw) -> httpx.Response:
    return httpx.post(server.base_url + path, headers=AUTH, timeout=300, **kw)


def test_routes_need_the_key_and_a_valid_level(server):
    assert httpx.post(server.base_url + "/sleep", timeout=30).status_code == 401
    assert httpx.get(server.base_url + "/is_sleeping", timeout=30).status_code == 401
    r = post(server, "/sleep", params={"level": 3})
    assert r.status_code == 400 and "level" in r.json()["error"]["message"]
    assert httpx.get(server.base_url + "/is_sleeping", headers=AUTH, timeout=30).json() == {
        "is_sleeping": False, "level": 0}


def test_a_request_sent_while_asleep_waits_for_wake_up(server):
    before = complete(server)
    r = post(server, "/sleep", params={"level": 2})
    assert r.status_code == 200 and r.json()["released_bytes"] > 0
    assert httpx.get(server.base_url + "/is_sleeping", headers=AUTH, timeout=30).json()["level"] == 2
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(complete(server)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not got  # waits while asleep (nothing can run)
    assert post(server, "/wake_up").status_code == 200
    waiter.join(120)
    assert got == [before]
    assert complete(server) == before


def test_reset_prefix_cache_and_update_weights(server, model_factory):
    complete(server)
    complete(server)  # its prompt's full blocks are cached now
    r = post(server, "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["evicted_blocks"] >= 1
    assert post(server, "/reset_prefix_cache").json()["evicted_blocks"] == 0
    before = complete(server)
    other = model_factory("llama", seed=11)
    r = post(server, "/update_weights", json={"model_path": str(other)})
    assert r.status_code == 200, r.text
    assert complete(server) != before
    bad = post(server, "/update_weights", json={"model_path": str(model_factory("qwen3"))})
    assert bad.status_code == 400 and "same architecture and shapes" in bad.json()["error"]["message"]
    missing = post(server, "/update_weights", json={"model_path": "/nonexistent/ckpt"})
    assert missing.status_code == 400
