"""Bad sizes fail before any process starts; a dead worker or a dead engine process never
leaves anything hanging or running."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tp_helpers import child_pids, wait_gone

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, EngineConfig
from pagoda.executor.tp_executor import check_tensor_parallel

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(20, 60))}


@pytest.mark.parametrize("spec, tp, message", [
    (dict(hidden_size=48, num_heads=6, num_kv_heads=6), 4,
     r"tensor_parallel_size 4 does not divide the model's 6 attention heads"),
    (dict(hidden_size=48, num_heads=6, num_kv_heads=2), 3,
     r"2 key/value heads are neither divisible by tensor_parallel_size 3 nor a divisor"),
    (dict(), 0, r"tensor_parallel_size must be at least 1, got 0"),
], ids=["heads", "kv-heads", "zero"])
def test_invalid_sizes_fail_before_any_process_starts(model_factory, spec, tp, message):
    path = model_factory("llama", **spec)
    before = child_pids()
    with pytest.raises(ValueError, match=message):
        LLM(str(path), tensor_parallel_size=tp, kv_cache_memory=1 << 20, max_model_len=64)
    assert child_pids() == before


def test_draft_model_speculation_is_refused(llama_dir):
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(llama_dir)}
    with pytest.raises(ValueError, match="draft_model does not support tensor_parallel_size 2"):
        LLM(str(llama_dir), tensor_parallel_size=2, speculative_config=spec, kv_cache_memory=1 << 20,
            max_model_len=64)


def test_failed_engine_start_stops_its_workers(llama_dir):
    with pytest.raises(ValueError, match="fewer than max_model_len"):  # workers already running
        LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=4096, max_model_len=1024)
    # the autouse fixture checks that no worker is left; a new engine may join a new group
    start(llama_dir).shutdown()


def test_refused_expert_parallel_leaves_the_process_clean(model_factory, llama_dir):
    """A configuration refused at start (expert parallelism over a rank count that does not
    divide the experts) sets nothing up: the next tensor-parallel engine here starts."""
    with pytest.raises(ValueError, match="does not divide the model's 5 experts"):
        LLM(str(model_factory("mixtral")), tensor_parallel_size=2, enable_expert_parallel=True)
    assert not torch.distributed.is_initialized()
    llm = start(llama_dir)
    try:
        assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()


# Rank 1 of a two-stage group, in its own process: it joins, then waits in vain for rank 0.
_OTHER_RANK = """
import sys
from pagoda.distributed.parallel_state import init_tensor_parallel
try:
    init_tensor_parallel(1, 2, sys.argv[1], "gloo", timeout_s=5, pipeline_size=2)
except Exception:
    pass
"""


def test_a_group_start_failing_after_the_group_formed_leaves_nothing(monkeypatch):
    """A failure between joining the process group and finishing the stage groups left the
    group initialised, so every later engine in the process was refused."""
    from pagoda.distributed import parallel_state as ps
    from pagoda.distributed.rendezvous import tcp_init_method

    def refuse(*args, **kwargs):
        raise RuntimeError("no stage groups today")

    monkeypatch.setattr(ps, "_new_pipeline_groups", refuse)
    init_method = tcp_init_method("127.0.0.1")
    other = subprocess.Popen([sys.executable, "-c", _OTHER_RANK, init_method])
    try:
        with pytest.raises(RuntimeError, match="no stage groups today"):
            ps.init_tensor_parallel(0, 2, init_method, "gloo", timeout_s=30, pipeline_size=2)
    finally:
        other.wait(60)
    assert not torch.distributed.is_initialized() and ps.get_store() is None
    assert ps.get_tp().size == 1 and ps.get_pp().size == 1


def test_more_ranks_than_gpus_is_refused(llama_dir, monkeypatch):
    config = EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", tensor_parallel_size=2))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs, but only 1 are visible"):
        check_tensor_parallel(dataclasses.replace(config, device="cuda"))


def start(path: Path) -> LLM:
    return LLM(str(path), tensor_parallel_size=2, kv_cache_memory=1 << 20, max_model_len=1024)


def test_worker_killed_while_idle_fails_the_next_step(llama_dir):
    llm = start(llama_dir)
    try:
        [pid] = llm.engine.core.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 5
        with pytest.raises(RuntimeError, match="rank 1"):  # and stays down
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_worker_killed_mid_generation_fails_promptly(llama_dir):
    llm = start(llama_dir)
    try:
        [pid] = llm.engine.core.executor.worker_pids
        long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        started = time.monotonic()
        # Fails rather than hangs: the loop gives up after a minute (a bound, not a timing: a
        # loaded machine may take seconds to notice, an engine that waits forever never ends).
        with pytest.raises(RuntimeError, match=r"worker rank 1 .* was killed by SIGKILL"):
            while time.monotonic() - started < 60:
                llm.generate([PROMPT] * 4, long, use_tqdm=False)
    finally:
        llm.shutdown()


# A second pagoda instance in another process: it finds its own rendezvous port, then ends
# without shutting its engine down (atexit must) or is killed outright (its workers must notice).
SCRIPT = """
import json, os, signal, sys
from pagoda import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory=1 << 20, max_model_len=1024)
out = llm.generate([{"prompt_token_ids": list(range(20, 60))}],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "workers": llm.engine.core.executor.worker_pids}), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("ending", ["exit", "kill"])
def test_two_instances_side_by_side_and_no_orphans(llama_dir, ending):
    here = start(llama_dir)
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        other = subprocess.run([sys.executable, "-c", SCRIPT, str(llama_dir), ending], env=env,
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == (-signal.SIGKILL if ending == "kill" else 0), other.stderr
        result = json.loads(other.stdout.strip().splitlines()[-1])
        assert not wait_gone(result["workers"], 10.0), "the other instance's workers outlived it"
        mine = here.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert mine == result["tokens"]
    finally:
        here.shutdown()
