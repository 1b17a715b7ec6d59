"""``pagoda bench fuzz`` against a real ``pagoda serve`` subprocess on a tiny checkpoint: no 5xx,
no unanswered request, no engine death over a seeded run of positive and negative cases; and the
engine-death watcher notices an engine core that is killed."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from pagoda.bench.fuzz import HealthWatch
from pagoda.entrypoints.cli import build_parser
from tests.entrypoints.server_helpers import engine_pid, start_server


@pytest.fixture
def server(llama_dir: Path, tmp_path: Path):
    srv = start_server(llama_dir, tmp_path)
    yield srv
    srv.stop()


def test_fuzz_bench_finds_no_server_error(server, tmp_path: Path, capsys) -> None:
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


def test_health_watch_counts_a_killed_engine_core(server) -> None:
    with HealthWatch(server.base_url) as watch:
        os.kill(engine_pid(server.base_url), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while watch.unhealthy == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert watch.unhealthy > 0 and watch.engine_deaths >= 1
