"""One engine over two "nodes" on this machine (two ``pagoda serve`` processes meeting over
loopback, one tensor-parallel rank each): the API on node 0 answers as one process does, both
nodes exit 0 on shutdown, losing the worker node fails the request in flight and the server;
and the flags are checked before anything starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tp_helpers import child_pids, free_port

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, EngineConfig
from pagoda.entrypoints.cli import main as cli_main

httpx = pytest.importorskip("httpx")

PROMPTS = ["def fibonacci(n):", "The capital of France", "1, 2, 3, 5, 8,"]
ENGINE = ["--kv-cache-memory", "8MiB", "--max-model-len", "512"]


# ---- flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (dict(nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:29500"), r"node_rank must be in 0 \.\. nnodes - 1 = 1, got 2"),
    (dict(nnodes=2, node_rank=-1, dist_init_addr="127.0.0.1:29500"), r"node_rank must be in 0 \.\. nnodes - 1"),
    (dict(nnodes=0), r"nnodes must be at least 1, got 0"),
    (dict(nnodes=3, dist_init_addr="127.0.0.1:29500"), r"engine's 2 ranks .* do not divide evenly over nnodes 3"),
    (dict(nnodes=2), r"nnodes > 1 needs dist_init_addr HOST:PORT"),
    (dict(nnodes=2, dist_init_addr="127.0.0.1"), r"dist_init_addr must be HOST:PORT .* got '127.0.0.1'"),
    (dict(nnodes=2, dist_init_addr="127.0.0.1:99999"), r"dist_init_addr must be HOST:PORT"),
    (dict(nnodes=2, dist_init_addr=":29500"), r"dist_init_addr must be HOST:PORT"),
], ids=["rank-high", "rank-negative", "zero-nodes", "indivisible", "no-addr", "no-port", "bad-port", "no-host"])
def test_bad_node_flags_are_refused(llama_dir, flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", tensor_parallel_size=2, **flags))


def test_node_layout_divides_the_ranks(llama_dir):
    config = EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", tensor_parallel_size=4,
                                               nnodes=2, node_rank=1, dist_init_addr="[::1]:29500"))
    p = config.parallel
    assert (p.world_size, p.ranks_per_node) == (4, 2)
    assert list(p.node_ranks(0)) == [0, 1] and list(p.node_ranks()) == [2, 3]
    assert [p.local_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_worker_node_cannot_host_an_engine(llama_dir):
    before = child_pids()
    with pytest.raises(ValueError, match="node_rank 1 runs worker ranks only"):
        LLM(str(llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500",
            kv_cache_memory=1 << 20, max_model_len=64)
    assert child_pids() == before


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--node-rank", "1"], "nnodes > 1 needs dist_init_addr"),
    (["--nnodes", "2", "--node-rank", "5", "--dist-init-addr", "127.0.0.1:1234"], "node_rank must be in 0 .. nnodes - 1 = 1, got 5"),
    (["--nnodes", "2", "--dist-init-addr", "localhost"], "dist_init_addr must be HOST:PORT"),
], ids=["worker-no-addr", "worker-rank", "node0-addr"])
def test_cli_refuses_bad_node_flags(llama_dir, capsys, flags, message):
    before = child_pids()
    code = cli_main(["serve", str(llama_dir), "--tensor-parallel-size", "2", "--port", str(free_port()), *flags])
    assert code == 1
    assert f"pagoda serve: error: {message}" in capsys.readouterr().err
    assert child_pids() == before


# ---- two nodes over loopback ----------------------------------------------------------------

class TwoNodes:
    """Node 1 (workers only) and node 0 (the API) as two ``pagoda serve`` processes."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TOKENIZERS_PARALLELISM="false")
        self.logs = [tmp / "node0.log", tmp / "node1.log"]
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(model), *ENGINE, *nodes]
        with open(self.logs[1], "wb") as out:  # the worker node first: it waits for node 0
            self.worker = subprocess.Popen(cmd + ["--node-rank", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)
        with open(self.logs[0], "wb") as out:
            self.server = subprocess.Popen(cmd + ["--port", self.url.rsplit(":", 1)[1], "--served-model-name", "tiny"],
                                           stdout=out, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in self.logs)

    def wait_healthy(self, timeout_s: float = 180) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in (self.server, self.worker):
                if proc.poll() is not None:
                    pytest.fail(f"a node exited with {proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"not healthy after {timeout_s} s:\n{self.log()}")

    def wait(self, proc: subprocess.Popen, timeout_s: float = 60) -> int:
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pid {proc.pid} still running {timeout_s} s later:\n{self.log()}")

    def kill_all(self) -> None:
        for proc in (self.server, self.worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def one_process_texts(model: Path) -> list[str]:
    llm = LLM(str(model), kv_cache_memory=8 << 20, max_model_len=512)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


def test_two_nodes_serve_like_one_process_and_shut_down_cleanly(llama_dir, tmp_path):
    nodes = TwoNodes(llama_dir, tmp_path)
    try:
        nodes.wait_healthy()
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = httpx.post(nodes.url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, got.text
        texts = [c["text"] for c in sorted(got.json()["choices"], key=lambda c: c["index"])]
        nodes.server.send_signal(signal.SIGTERM)
        assert nodes.wait(nodes.server) == 0, nodes.log()
        assert nodes.wait(nodes.worker) == 0, nodes.log()  # the worker node ends with the engine
    finally:
        nodes.kill_all()
    assert texts == one_process_texts(llama_dir)


def test_losing_the_worker_node_fails_the_request_and_the_server(llama_dir, tmp_path):
    nodes = TwoNodes(llama_dir, tmp_path)
    try:
        nodes.wait_healthy()
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                "stream": True}
        chunks, killed = [], threading.Event()
        with httpx.stream("POST", nodes.url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[len("data: "):]))
                if not killed.is_set():  # generation is under way: the worker node vanishes
                    nodes.worker.send_signal(signal.SIGKILL)
                    killed.set()
        assert killed.is_set()
        errors = [c["error"] for c in chunks if "error" in c]
        tokens = sum(1 for c in chunks if "choices" in c and c["choices"] and c["choices"][0].get("text"))
        assert errors, f"the stream ended without an error after {tokens} tokens:\n{nodes.log()}"
        assert "rank" in errors[0]["message"] and tokens < 480
        assert nodes.wait(nodes.server) != 0, nodes.log()  # the server exits, non-zero
        assert "exiting because" in nodes.logs[0].read_text()
    finally:
        nodes.kill_all()


def test_pipeline_stages_on_two_nodes_match_one_process(llama_dir, tmp_path):
    """Pipeline x nodes: two stages, one per node (node 0, here an offline ``LLM``, holds rank 0
    and so the last stage); the worker node exits 0 when the engine shuts down."""
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    log = tmp_path / "node1.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(llama_dir), *ENGINE,
                                   *nodes, "--node-rank", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=512, pipeline_parallel_size=2, nnodes=2,
                  node_rank=0, dist_init_addr=addr)
        try:
            assert llm.engine.core.executor.worker_pids == []  # the other rank runs on node 1
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        finally:
            llm.shutdown()
        assert worker.wait(60) == 0, log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    assert [o.outputs[0].text for o in outs] == one_process_texts(llama_dir)


def test_node_monitor_declares_a_silent_node_lost():
    import datetime
    import time

    import torch.distributed as dist

    from pagoda.executor.nodes import NodeMonitor, heartbeat_key

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    monitor = NodeMonitor(store, range(1, 3), timeout_s=1.5)
    try:
        deadline = time.monotonic() + 60
        while monitor.lost is None and time.monotonic() < deadline:
            store.add(heartbeat_key(1), 1)  # node 1 beats, node 2 is silent
            time.sleep(0.2)
        assert monitor.lost is not None and monitor.lost.startswith("worker node 2 sent no heartbeat")
    finally:
        monitor.stop()


def test_a_node_started_with_other_flags_is_refused(llama_dir, tmp_path):
    """Each node builds its engine from its own flags: a worker node whose model or sizes differ
    from node 0's (here max_model_len) refuses to join, and node 0 says why."""
    addr = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    log = tmp_path / "node1.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(llama_dir),
                                   "--kv-cache-memory", "8MiB", "--max-model-len", "256", "--tensor-parallel-size",
                                   "2", "--nnodes", "2", "--dist-init-addr", addr, "--node-rank", "1"],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        with pytest.raises(ValueError, match=r"rank 1 \(node 1\) was started with a different model than node 0"):
            LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=512, tensor_parallel_size=2, nnodes=2,
                node_rank=0, dist_init_addr=addr)
        assert worker.wait(60) != 0, log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
