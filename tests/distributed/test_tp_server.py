"""``pagoda serve --tensor-parallel-size 2``: the engine-core process starts its worker, the
OpenAI client gets the single-rank engine's answers, and after shutdown no process remains."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tp_helpers import child_pids, free_port, wait_gone

pytest.importorskip("pagoda.entrypoints.openai.server", reason="the OpenAI server is not in this tree yet")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pagoda import LLM, SamplingParams  # noqa: E402

PROMPT = "def fibonacci(n):"


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = child_pids(todo.pop())
        found |= kids
        todo.extend(kids)
    return found


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during start-up:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not healthy after {timeout_s} s:\n{log.read_text()}")


def test_server_with_two_ranks(llama_dir, tmp_path):
    engine_args = ["--kv-cache-memory", "8MiB", "--max-model-len", "512"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(llama_dir),
                                 "--port", str(port), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                                 *engine_args], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, log)
        family = descendants(proc.pid)
        assert len(family) >= 2, f"expected the engine core and its worker, found {sorted(family)}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=12, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, log.read_text()
    assert not wait_gone(family, 10.0), f"left running after shutdown:\n{log.read_text()}"

    one_rank = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=512)
    try:
        want = one_rank.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        chat = one_rank.chat([{"role": "user", "content": PROMPT}], SamplingParams(temperature=0, max_tokens=12),
                             use_tqdm=False)
    finally:
        one_rank.shutdown()
    assert got.choices[0].text == want[0].outputs[0].text
    assert streamed == chat[0].outputs[0].text
