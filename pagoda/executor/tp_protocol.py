"""What the ranks of one engine agree on when they start, torch-free: the arguments rank 0 (or a
worker node, ``nodes.WorkerNode``) hands each worker process it spawns (``WorkerArgs``,
``spawn_worker``), the collectives' time bound, and the engine fingerprint every rank checks
in the store before it loads anything (``publish_engine`` / ``check_same_engine``).

The launchers (``tp_executor``, ``nodes``) and the worker (``tp_worker``) all import this
module; it imports none of them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass

from pagoda.config import EngineConfig
from pagoda.omp import passive_env

# Bounds every collective of a step: a rank that stops answering becomes an error after this.
STEP_TIMEOUT_S = float(os.environ.get("PAGODA_TP_TIMEOUT_S", 120))


@dataclass(frozen=True)
class WorkerArgs:
    """What rank 0 hands a worker (pickled on the worker's stdin)."""

    config: EngineConfig
    rank: int
    size: int
    init_method: str
    backend: str
    timeout_s: float
    parent_pid: int
    connect_timeout_s: float | None = None  # waiting for other nodes (default: timeout_s)


ENGINE_KEY = "pagoda/engine"  # what node 0 runs: every rank checks that it runs the same
ERROR_KEY = "pagoda/error"  # a rank's reason for refusing to join, for node 0 to report


def engine_fingerprint(config: EngineConfig) -> dict[str, str]:
    """What every rank must agree on (each node builds its config from its own flags): the
    model's shape and checkpoint config, dtypes, parallel sizes, cache layout and LoRA slots.
    Paths may differ between machines."""
    model = {f.name: getattr(config.model, f.name) for f in dataclasses.fields(config.model)
             if f.name not in ("path", "tokenizer", "hf_config")}
    hf = {k: v for k, v in config.model.hf_config.items() if not k.startswith("_")}
    p = config.parallel
    return {"model": json.dumps(model, sort_keys=True, default=str), "checkpoint config": json.dumps(hf, sort_keys=True),
            "parallel sizes": f"tp={p.tensor_parallel_size} pp={p.pipeline_parallel_size} nnodes={p.nnodes} "
                              f"expert_parallel={p.enable_expert_parallel}",
            "device": config.device.split(":")[0], "KV cache": f"block_size={config.cache.block_size} "
                                                            f"dtype={config.cache.kv_cache_dtype}",
            "LoRA": repr(config.lora)}


def publish_engine(store: object, config: EngineConfig) -> None:
    """Rank 0: say what engine the other ranks join."""
    store.set(ENGINE_KEY, json.dumps(engine_fingerprint(config)))  # type: ignore[attr-defined]


def check_same_engine(store: object, config: EngineConfig, rank: int) -> None:
    """A worker rank: refuse (ValueError, also left in the store for node 0) to join an engine
    whose model or sizes differ from this node's flags."""
    theirs = json.loads(store.get(ENGINE_KEY))  # type: ignore[attr-defined]
    mine = engine_fingerprint(config)
    differ = [key for key in mine if theirs.get(key) != mine[key]]
    if differ:
        message = (f"rank {rank} (node {config.parallel.node_rank}) was started with a different "
                   f"{', '.join(differ)} than node 0: every node needs the same model and engine flags")
        store.set(ERROR_KEY, message)  # type: ignore[attr-defined]
        raise ValueError(message)


def rank_error(store: object) -> str | None:
    """The reason a rank gave for refusing to join, if any."""
    try:
        if store.check([ERROR_KEY]):  # type: ignore[attr-defined]
            return store.get(ERROR_KEY).decode()  # type: ignore[attr-defined]
    except Exception:  # the store itself is gone: nothing to add
        pass
    return None


def spawn_worker(args: WorkerArgs) -> subprocess.Popen:
    """Start one worker rank (``tp_worker.main``) with ``args`` on its stdin.
    Workers import what we import and sleep at once between parallel regions (ranks share cores)."""
    env = passive_env(dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    proc = subprocess.Popen([sys.executable, "-c", "from pagoda.executor.tp_worker import main; main()"],
                            stdin=subprocess.PIPE, env=env, start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc
