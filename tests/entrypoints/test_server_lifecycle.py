"""``pagoda serve`` start-up failures, API keys, the engine core dying under load, and a
graceful SIGTERM, each against real subprocesses."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import psutil
import pytest

from server_helpers import ServerProcess, engine_pid, frozen, side_by_side, serve_command

API_KEY = "sekret"
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Three servers, started side by side to cut the wait: one with an API key (and later a
    dead engine), one to be shut down with SIGTERM, one to be killed outright."""
    log_dir = tmp_path_factory.mktemp("lifecycle-logs")
    # Own temp folders, to see what a SIGKILL of the server or of its engine core leaves there.
    keyed_tmp, orphan_tmp = tmp_path_factory.mktemp("keyed-tmp"), tmp_path_factory.mktemp("orphan-tmp")
    started = {"keyed": ServerProcess(llama_dir, log_dir, "--api-key", API_KEY, "--served-model-name", "tiny",
                                      set_env={"TMPDIR": str(keyed_tmp)}),
               # started as a user would, with no OpenMP policy of their own
               "plain": ServerProcess(llama_dir, log_dir, "--served-model-name", "tiny", "--shutdown-timeout", "30",
                                      drop_env=("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")),
               "orphan": ServerProcess(llama_dir, log_dir, set_env={"TMPDIR": str(orphan_tmp)})}
    with side_by_side(started):
        yield started


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background, recording every SSE payload."""

    def __init__(self, base_url: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.base_url, self.body, self.headers = base_url, {**body, "stream": True}, headers or {}
        self.events: list[dict] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base_url + "/v1/completions", json=self.body, headers=self.headers,
                              timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        self.events.append(json.loads(line[5:]))
                        self.started.set()
        except BaseException as exc:  # recorded for the test to inspect
            self.error = exc
        finally:
            self.started.set()


def test_startup_failures_exit_nonzero_with_the_reason(llama_dir: Path, tmp_path: Path) -> None:
    missing = subprocess.Popen(serve_command(str(tmp_path / "no-such-model"), "--port", "1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # A KV cache of two blocks cannot hold one max_model_len request: the engine core refuses.
    too_small = subprocess.Popen(serve_command(str(llama_dir), "--port", "1", "--kv-cache-memory", "16KiB",
                                               "--max-model-len", "512"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = missing.communicate(timeout=180)
    assert missing.returncode != 0 and "does not exist" in err, err
    _, err = too_small.communicate(timeout=180)
    assert too_small.returncode != 0 and "fewer than max_model_len" in err, err


def test_api_key(servers: dict[str, ServerProcess]) -> None:
    srv = servers["keyed"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.get(srv.base_url + "/v1/models", headers=headers)
        assert resp.status_code == 401 and set(resp.json()["error"]) == ERROR_FIELDS
    resp = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 401
    assert httpx.get(srv.base_url + "/health").status_code == 200  # probes need no key
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model="tiny", prompt="with the key", max_tokens=3, temperature=0)
    assert len(out.choices) == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_engine_core_inherits_the_short_openmp_spin(servers: dict[str, ServerProcess]) -> None:
    """A server started with no OpenMP policy of the user's: its engine core waits between
    parallel regions as the API process does, with pagoda's short spin (GOMP_SPINCOUNT=10000),
    not switched to passive (which cost 1.2-1.4x in time per output token at batch 1)."""
    env = psutil.Process(engine_pid(servers["plain"].base_url)).environ()
    assert env.get("GOMP_SPINCOUNT") == "10000" and "OMP_WAIT_POLICY" not in env


def test_engine_death_fails_requests_and_exits_nonzero(servers: dict[str, ServerProcess]) -> None:
    srv = servers["keyed"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    pid = engine_pid(srv.base_url)
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert pid in [c.pid for c in children]
    body = {"model": "tiny", "prompt": "doomed " * 8, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    stream = StreamReader(srv.base_url, body, headers)
    result: dict = {}
    blocking = threading.Thread(target=lambda: result.update(
        resp=httpx.post(srv.base_url + "/v1/completions", json=body, headers=headers, timeout=120)), daemon=True)
    stream.start()
    assert stream.started.wait(60) and stream.events, stream.error
    with frozen(pid):  # keep both requests in flight until the engine is killed
        blocking.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
    stream.join(60)
    blocking.join(60)
    assert not stream.is_alive() and not blocking.is_alive(), "in-flight requests hung"
    # The bar a supervisor relies on: every in-flight client hears within 5 s.
    assert time.monotonic() - killed < 5.0
    assert "error" in stream.events[-1], stream.events[-1]
    assert set(stream.events[-1]["error"]) == ERROR_FIELDS
    assert result["resp"].status_code == 503 and "engine" in result["resp"].json()["error"]["message"]

    try:  # the server lingers a moment to say why it goes (a very slow machine may miss it)
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and set(health.json()["error"]) == ERROR_FIELDS
    except httpx.ConnectError:
        pass
    assert srv.proc.wait(60) != 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert not ipc_dirs(srv)  # the engine core was SIGKILLed: no socket folder is left behind


def test_sigterm_lets_in_flight_requests_finish_and_leaves_no_children(servers: dict[str, ServerProcess]) -> None:
    srv = servers["plain"]
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert children
    body = {"model": "tiny", "prompt": "finish me", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    stream = StreamReader(srv.base_url, body)
    stream.start()
    assert stream.started.wait(60) and stream.events, stream.error
    with frozen(engine_pid(srv.base_url)):  # the request cannot finish before the signal
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(srv.base_url + "/health")
    stream.join(60)
    assert stream.error is None and stream.events[-1]["usage"]["completion_tokens"] == 40
    assert srv.proc.wait(60) == 0, srv.log()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    # The server ends without the interpreter's teardown (``pagoda.process_exit``), its last log
    # lines flushed first: the engine core's stop is the last thing it logs.
    assert srv.log().rstrip().endswith("engine core stopped"), srv.log()[-2000:]
    # Its start-up objects had been frozen out of the collector's full scans (gc_freeze.py).
    assert re.search(r"[1-9]\d{4,} start-up objects frozen out", srv.log()), srv.log()[-4000:]


def test_engine_exits_by_itself_when_the_server_is_killed(servers: dict[str, ServerProcess]) -> None:
    srv = servers["orphan"]
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert not ipc_dirs(srv)  # removed once the engine core connected, before any crash
    srv.proc.kill()  # no chance to clean up: the engine core must notice it is orphaned
    srv.proc.wait(30)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert not ipc_dirs(srv)


def ipc_dirs(srv: ServerProcess) -> list[str]:
    """The engine sockets' folders in the server's own temp folder."""
    tmp = Path(srv.env["TMPDIR"])
    return [p.name for p in tmp.iterdir() if p.name.startswith("pagoda-ipc-")]


def test_a_socket_folder_left_by_a_dead_server_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """A server killed before its engine core connected leaves its folder; the next start
    removes it (its owner's pid is dead) and keeps a live server's."""
    from pagoda.engine.core_client import remove_stale_ipc_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = tmp_path / f"pagoda-ipc-{dead.pid}-x1", tmp_path / f"pagoda-ipc-{os.getpid()}-x2"
    other = tmp_path / "pagoda-ipc-notapid"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "input").write_text("")
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
