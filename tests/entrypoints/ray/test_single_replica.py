"""``pagoda serve MODEL --num-replicas 1`` is the single server: it runs, and answers, in a
process where Ray cannot be imported at all."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_helpers import ServerProcess

NO_RAY = '''raise ImportError("this test hides Ray: pagoda serve must not need it here")\n'''


@pytest.fixture()
def ray_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``ray`` package first on the path whose import fails, for the server subprocesses."""
    (tmp_path / "hide" / "ray").mkdir(parents=True)
    (tmp_path / "hide" / "ray" / "__init__.py").write_text(NO_RAY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "hide"), os.environ.get("PYTHONPATH", "")]))


def test_one_replica_is_the_single_server_without_ray(llama_dir: Path, tmp_path: Path, ray_hidden: None) -> None:
    # The control: with Ray hidden, a real scale-out request fails for want of Ray...
    two = ServerProcess(llama_dir, tmp_path, "--num-replicas", "2")
    assert two.proc.wait(120) == 1
    assert "need Ray Serve" in two.log() and "this test hides Ray" in two.log()

    # ... while --num-replicas 1 is the plain server and serves.
    one = ServerProcess(llama_dir, tmp_path, "--num-replicas", "1", "--served-model-name", "tiny")
    try:
        one.wait_ready()
        health = httpx.get(one.base_url + "/health", timeout=30)
        assert health.status_code == 200 and "replicas" not in health.text  # no Ray ingress report
        r = httpx.post(one.base_url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert one.stop() == 0, one.log()
