"""Schemathesis against a live ``pagoda serve``, from the server's own ``/openapi.json``: a few
hundred generated requests (valid and invalid by the document, fixed seed) must get no 5xx,
only documented statuses and content types, bodies matching the documented schemas, and a 4xx
for every invalid one; the engine core must be the same process, healthy, at the end.

The same server takes ``pagoda bench fuzz`` (the command around the same driver: no 5xx, no
unanswered request, no engine death over a seeded run), and last (it kills the engine core) the
bench's engine-death watcher must notice the killed engine. One server for the three: each
start costs seconds of the suite.

The server runs with a small ``--max-model-len`` so that whatever ``max_tokens`` and ``n`` the
generator picks, a request is either cheap or refused at once."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pagoda.bench.fuzz import HealthWatch
from pagoda.bench.fuzz_core import run_fuzz
from pagoda.entrypoints.cli import build_parser
from server_helpers import ServerProcess, engine_pid, start_server

SEED = 20261123
CASES = 400
# The run stops starting cases after this long (it takes ~20 s on 2 cores); a slower machine
# still checks what it got through.
TIME_BUDGET_S = 120.0


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(llama_dir, tmp_path_factory.mktemp("fuzz-logs"), "--max-model-len", "64",
                       "--served-model-name", "tiny")
    yield srv
    srv.stop()


def test_schemathesis_finds_nothing(server: ServerProcess) -> None:
    pid = engine_pid(server.base_url)
    report = run_fuzz(server.base_url, cases=CASES, seed=SEED, time_budget_s=TIME_BUDGET_S)
    details = "\n".join(f"{e.operation} [{e.mode}] {e.check} ({e.status}): {e.request}\n{e.detail}"
                        for e in report.examples)
    assert report.ok, f"{report.summary()}\n{details}\n--- server log ---\n{server.log()[-5000:]}"
    assert report.by_status.get("5xx", 0) == 0 and report.by_status.get("error", 0) == 0
    assert report.cases >= CASES // 2 or report.stopped_early, report.summary()
    assert report.by_status.get("2xx", 0) > 0 and report.by_status.get("4xx", 0) > 0, report.summary()
    assert report.by_operation["POST /v1/completions"] > 0 and report.by_operation["POST /v1/chat/completions"] > 0
    assert report.by_operation["POST /v1/messages"] > 0 and report.by_operation["POST /v1/messages/count_tokens"] > 0
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert health.status_code == 200, health.text
    assert health.json()["engine_pid"] == pid  # the engine core never died


def test_fuzz_bench_finds_no_server_error(server: ServerProcess, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fuzz.json"
    args = build_parser().parse_args(["bench", "fuzz", "--base-url", server.base_url, "--cases", "120",
                                      "--seed", "7", "--time-budget", "120", "--out", str(out)])
    code = args.func(args)
    result = json.loads(out.read_text())
    assert result["5xx"] == 0 and result["no_response"] == 0, result["examples"]
    assert result["engine_deaths"] == 0 and len(result["engine_pids"]) == 1
    # The cases are shared over the server's operations (each gets at least one per mode), so
    # the count moves with the API's size; 40 means the run went well past one case each.
    assert result["cases"] >= 40 and result["4xx"] > 0  # negative cases ran and were refused
    assert result["cases"] == result["2xx"] + result["4xx"]
    assert code == 0, capsys.readouterr().out
    assert "engine deaths" in capsys.readouterr().out


def test_health_watch_counts_a_killed_engine_core(server: ServerProcess) -> None:
    """Last in the module: it kills the server's engine core."""
    with HealthWatch(server.base_url) as watch:
        os.kill(engine_pid(server.base_url), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while watch.unhealthy == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert watch.unhealthy > 0 and watch.engine_deaths >= 1
