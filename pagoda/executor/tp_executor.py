"""Tensor parallelism across processes, behind the same interface as ``ModelRunner``.

Rank 0 lives in the engine-core process and is an ordinary ``ModelRunner`` built after joining
the group; ranks 1..N-1 are worker processes (one per GPU on CUDA). Each step rank 0 prepares
the inputs, broadcasts them (``tp_worker.StepChannel``), runs its own slice of the forward with
the workers, and samples from the gathered logits.

Workers are fresh interpreters, as with multiprocessing's spawn, but started as ``python -c``
subprocesses rather than ``multiprocessing.Process``: the user's ``__main__`` script is never
re-run in them (no ``if __name__ == "__main__"`` guard needed), a daemonic process may still
start them, and in their own session they do not get the terminal's Ctrl-C (rank 0 decides).

Failure policy: a worker that dies takes the engine down with an error naming it, never a hang.
Rank 0 checks that every worker is alive before each message, every collective inside a step
is bounded by ``STEP_TIMEOUT_S`` (env ``PAGODA_TP_TIMEOUT_S``), and workers exit when rank 0's
process goes away.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

import msgspec
import torch

from pagoda.config import EngineConfig, check_split_sizes
from pagoda.distributed.parallel_state import (destroy_tensor_parallel, get_pp, get_store, host_all_gather,
                                               host_all_reduce_min, init_tensor_parallel)
from pagoda.distributed.rendezvous import init_method_host, is_loopback, pin_to_loopback, tcp_init_method
from pagoda.executor.input import LogitsPlan, ModelInput, inputs_to_device
from pagoda.executor.interface import StepPhases
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.nodes import NODE_WAIT_S, NodeMonitor, rendezvous_method, wait_nodes_done
from pagoda.executor.pipeline import StageStats, StageTimes, stage_stats
from pagoda.executor.sampler import SeedGenerators
from pagoda.lora.request import LoRARequest
from pagoda.executor.tp_protocol import STEP_TIMEOUT_S, WorkerArgs, publish_engine, rank_error, spawn_worker
from pagoda.executor.tp_worker import (LOAD_TIMEOUT_S, Command, StepChannel, capture_graphs_together,
                                       cpu_threads_per_rank, rank_config, run_step)
from pagoda.step import ModelOutput

if TYPE_CHECKING:
    from pagoda.executor.kv_offload import ShardedKVCodec
    from pagoda.kvcache.tiers.base import KVTransfers
    from pagoda.kvcache.tiers.store import TieredStore
    from pagoda.step import SchedulerOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a clean shutdown waits for workers before terminating them.
SHUTDOWN_GRACE_S = 10.0
# After a failed collective, how long to wait for the worker that caused it to be reaped.
DEATH_GRACE_S = 2.0
_POLL_S = 0.05


def check_tensor_parallel(config: EngineConfig) -> None:
    """Reject sizes the model cannot be split into, and what the ranks cannot run here (a draft
    model, too few GPUs, a worker node's flags), before any process starts."""
    check_split_sizes(config)
    n = config.parallel.tensor_parallel_size
    if config.speculative is not None and config.speculative.method == "draft_model" and n > 1:
        raise ValueError(f"speculative method draft_model does not support tensor_parallel_size {n} yet "
                         f"(the draft model would be split too); use ngram or tensor_parallel_size 1")
    p, local = config.parallel.pipeline_parallel_size, config.parallel.ranks_per_node
    if config.device.startswith("cuda") and local > torch.cuda.device_count():
        sizes = f"tensor_parallel_size {n}" + (f" x pipeline_parallel_size {p}" if p > 1 else "")
        per_node = f" on each of {config.parallel.nnodes} nodes" if config.parallel.nnodes > 1 else ""
        raise ValueError(f"{sizes} needs {local} GPUs{per_node}, but only {torch.cuda.device_count()} are visible")
    if config.parallel.node_rank != 0:
        raise ValueError(f"node_rank {config.parallel.node_rank} runs worker ranks only, not an engine: start it "
                         f"with `pagoda serve MODEL --nnodes N --node-rank K --dist-init-addr HOST:PORT`")


class TPExecutor(StepPhases):
    """N-way tensor-parallel ``Executor`` (``executor.interface``), interchangeable with a
    ``ModelRunner``; with pipeline parallelism P stages of N ranks each (``executor.pipeline``),
    rank 0 on the last stage. KV-cache figures are per rank: every rank holds the same number
    of blocks, each with only its own heads of its own stage's layers."""

    def __init__(self, config: EngineConfig) -> None:
        check_tensor_parallel(config)
        self.config = config
        self.pipeline_size = config.parallel.pipeline_parallel_size
        self.size = config.parallel.tensor_parallel_size * self.pipeline_size  # ranks in all
        self.times = StageTimes()
        self.channel = StepChannel()
        self.kv_offload: ShardedKVCodec | None = None  # KV tiers' copies (attach_kv_store)
        self._procs: list[subprocess.Popen] = []
        self._nodes: NodeMonitor | None = None  # other machines' heartbeats (multi-node)
        self._started = False
        self._error: str | None = None
        self._closed = False
        self._saved_threads = torch.get_num_threads()
        atexit.register(self.shutdown)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        on_gpu = self.config.device.startswith("cuda")
        backend = "nccl" if on_gpu else "gloo"
        parallel = self.config.parallel
        init_method = rendezvous_method(self.config) or tcp_init_method(parallel.init_address)
        if is_loopback(init_method_host(init_method)):
            pin_to_loopback()  # before spawning: workers inherit the environment
        if on_gpu:
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(cpu_threads_per_rank(parallel.ranks_per_node))
        self._spawn_workers(init_method, backend)
        connect_s = NODE_WAIT_S if parallel.nnodes > 1 else None
        self._while_workers_live(lambda: init_tensor_parallel(0, self.size, init_method, backend, STEP_TIMEOUT_S,
                                                              self.pipeline_size, connect_s))
        store = get_store()
        publish_engine(store, self.config)
        if parallel.nnodes > 1:
            self._nodes = NodeMonitor(store, range(1, parallel.nnodes))
        self.runner = ModelRunner(rank_config(self.config, 0))
        try:
            self._while_workers_live(lambda: host_all_reduce_min(0, LOAD_TIMEOUT_S))  # every rank has loaded
        except Exception as exc:
            refused = rank_error(store)
            if refused is not None:
                raise ValueError(refused) from exc
            raise
        self._started = True
        logger.info("tensor parallel: %d ranks in %d pipeline stage(s) on %d node(s) (%s, rendezvous %s)", self.size,
                    self.pipeline_size, parallel.nnodes, backend, init_method)

    def _spawn_workers(self, init_method: str, backend: str) -> None:
        connect_s = NODE_WAIT_S if self.config.parallel.nnodes > 1 else None
        for rank in self.config.parallel.node_ranks(0)[1:]:  # this node's ranks; rank 0 is this process
            args = WorkerArgs(self.config, rank, self.size, init_method, backend, STEP_TIMEOUT_S, os.getpid(),
                              connect_timeout_s=connect_s)
            self._procs.append(spawn_worker(args))

    def _while_workers_live(self, fn: Callable[[], T]) -> T:
        """Run a blocking start-up collective in a helper thread while watching the workers, so a
        worker that dies before answering is reported at once instead of after a timeout."""
        result: list[T] = []
        failure: list[BaseException] = []

        def target() -> None:
            try:
                result.append(fn())
            except BaseException as exc:  # handed to the calling thread
                failure.append(exc)

        thread = threading.Thread(target=target, name="pagoda-tp-startup", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            self._check_workers()
        if failure:
            raise failure[0]
        return result[0]

    # ---- the executor interface ------------------------------------------------------------
    @property
    def generators(self) -> SeedGenerators:
        """Rank 0 samples for every rank: its generators are the executor's."""
        return self.runner.generators

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def capture_cuda_graphs(self) -> None:
        """Every rank captures its own decode graphs at once (``capture_graphs_together``)."""
        def capture() -> None:
            self.channel.send(Command.CAPTURE_GRAPHS)
            capture_graphs_together(self.runner)

        self._guarded(capture)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def determine_num_blocks(self) -> int:
        """The fewest blocks any rank can hold (ranks with less free memory bound the rest)."""
        return self._guarded(self._determine_num_blocks)

    def _determine_num_blocks(self) -> int:
        self.channel.send(Command.DETERMINE_NUM_BLOCKS)
        return host_all_reduce_min(self.runner.determine_num_blocks())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        def allocate() -> None:
            self.channel.send(Command.ALLOCATE_KV_CACHE, num_blocks)
            self.runner.allocate_kv_cache(num_blocks)

        self._guarded(allocate)

    def attach_kv_store(self, store: TieredStore) -> None:
        """Serve the KV tiers' copies (``transfer_kv``): each rank moves its share of every
        block, rank 0's ``store`` keeps the whole payloads (``kv_offload.ShardedKVCodec``)."""
        from pagoda.executor.kv_offload import KVBlockCodec, ShardedKVCodec

        def attach() -> None:
            self.channel.send(Command.KV_ATTACH)
            self.kv_offload = ShardedKVCodec(KVBlockCodec(self.runner.kv_cache, self.runner.kv_scales, store))

        self._guarded(attach)

    def transfer_kv(self, transfers: KVTransfers) -> None:
        """Do KV-tier copies on every rank at once: snapshots of blocks going out, then loads."""
        message = self.kv_offload.encode(transfers)

        def transfer() -> None:
            self.channel.send_bytes(Command.KV_TRANSFER, 0, message)
            self.kv_offload.run(message, transfers.saves)

        self._guarded(transfer)

    # Async scheduling (``engine/async_scheduling.StepPipeline``) runs a step in these parts: the
    # step is built on the host, so the worker fills its placeholders there before shipping it.
    ships_host_inputs = True

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def begin_step(self, sched: SchedulerOutput) -> None:
        """What a step does before its forward: drop finished requests' generators, KV-tier
        copies; an empty step's block copies (a step with rows ships its own)."""
        self.runner.generators.drop(sched.finished_request_ids)
        if sched.kv_transfers:
            self.transfer_kv(sched.kv_transfers)
        if sched.is_empty and sched.block_copies:
            self._guarded(lambda: self._ship_and_run(None, sched.block_copies, []))

    def prepare(self, sched: SchedulerOutput, device: torch.device | None = None) -> tuple[ModelInput, LogitsPlan]:
        """The step's tensors and plan, built on the host (a multimodal step's features stay where
        the encoder put them): the workers get them from there, and rank 0 moves its own copy to
        its device without a stream sync."""
        if device is None and self.runner.mm is None:
            device = torch.device("cpu")
        return self.runner.prepare(sched, device)

    def run_step(self, sched: SchedulerOutput, inputs: ModelInput, plan: LogitsPlan) -> ModelOutput:
        """Ship a prepared, non-empty step to the workers, run rank 0's part, sample."""
        placements = self.runner.lora.take_placements() if self.runner.lora is not None else []
        logits = self._guarded(lambda: self._ship_and_run(inputs, sched.block_copies, placements))
        if logits is None:
            return ModelOutput()
        return self.runner.sample(plan, logits)

    def _ship_and_run(self, inputs: ModelInput | None, copies: list[tuple[int, int]],
                      placements: list) -> torch.Tensor | None:
        for slot, request in placements:  # the adapters rank 0 just placed, on every rank
            self.channel.send_bytes(Command.LORA_PLACE, slot, msgspec.msgpack.encode(request))
        self.channel.send(Command.STEP, inputs=inputs, copies=copies)
        own = inputs_to_device(inputs, self.runner.device) if inputs is not None else None
        return run_step(self.runner, own, copies, self.times)

    def stage_stats(self, reset: bool = False) -> list[StageStats]:
        """Per pipeline stage, first stage first: mean step time and time waiting for input since
        the last reset (what ``pagoda bench latency/throughput`` print)."""
        def gather() -> list[list[float]]:
            self.channel.send(Command.STAGE_TIMES, int(reset))
            per_rank = host_all_gather(self.times.values())
            if reset:
                self.times.reset()
            return per_rank

        return stage_stats(self._guarded(gather), self.pipeline_size, self.config.parallel.tensor_parallel_size)

    def add_lora(self, request: LoRARequest) -> None:
        """Checked and cached on rank 0; the other ranks load it when a step places it."""
        self.runner.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> None:
        def remove() -> None:
            self.channel.send_bytes(Command.LORA_REMOVE, lora_int_id, b"")
            self.runner.remove_lora(lora_int_id)

        self._guarded(remove)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by signal) and leave the group. Idempotent; also
        runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._error is None and get_pp().world_size > 1 and self._dead_worker() is None:
            try:
                self.channel.send(Command.SHUTDOWN)
            except Exception:  # a worker failing now changes nothing: it is stopped below
                logger.debug("shutdown message not delivered", exc_info=True)
        self._stop_workers(SHUTDOWN_GRACE_S)
        if self._nodes is not None:
            self._nodes.stop()
            if self._error is None and self._started:
                wait_nodes_done(get_store(), self._nodes.nodes, SHUTDOWN_GRACE_S)
        destroy_tensor_parallel()
        torch.set_num_threads(self._saved_threads)
        runner = getattr(self, "runner", None)
        if runner is not None:  # rank 0's weights and cache, in this process
            runner.shutdown()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- failure handling ------------------------------------------------------------------
    def _guarded(self, fn: Callable[[], T]) -> T:
        """Run one exchange with the workers. Any failure is fatal: the ranks may have fallen
        out of step, so the workers are stopped and this and every later call raise."""
        if self._error is not None:
            raise RuntimeError(self._error)
        self._check_workers()
        try:
            return fn()
        except Exception as exc:
            message = self._dead_worker(DEATH_GRACE_S) or f"tensor-parallel rank 0 failed: {exc}{self._remote_hint()}"
            self._fail(message)
            raise RuntimeError(message) from exc
        except BaseException:  # e.g. SIGTERM mid-step: the workers may be mid-message, so no
            self._error = "interrupted during an exchange with the workers"  # polite shutdown
            raise

    def _check_workers(self) -> None:
        message = self._dead_worker()
        if message is not None:
            self._fail(message)
            raise RuntimeError(message)

    def _dead_worker(self, wait_s: float = 0.0) -> str | None:
        """Describe the first worker that has exited (or node lost), waiting up to ``wait_s`` for one to."""
        deadline = time.monotonic() + (wait_s if self._procs else 0.0)  # no local worker to reap
        while True:
            if self._nodes is not None and self._nodes.lost is not None:
                return self._nodes.lost
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is not None:
                    return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) {_describe_exit(code)}; "
                            f"the engine cannot continue")
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def _remote_hint(self) -> str:
        nnodes = self.config.parallel.nnodes
        return (f" (the engine spans {nnodes} nodes: a rank on another node may have gone away)"
                if nnodes > 1 else "")

    def check_health(self) -> None:
        """Raise if a worker or another node has been lost, also while no step runs."""
        if self._error is not None:
            raise RuntimeError(self._error)
        self._check_workers()

    def _fail(self, message: str) -> None:
        logger.error("%s", message)
        self._error = message
        self._stop_workers(0.0)
        destroy_tensor_parallel()

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            _wait(proc, deadline - time.monotonic())
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            if not _wait(proc, 2.0):
                proc.kill()
                proc.wait()


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    try:
        proc.wait(max(0.0, timeout_s))
        return True
    except subprocess.TimeoutExpired:
        return False


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name} (exit code {code})"
    except ValueError:
        return f"was killed by signal {-code} (exit code {code})"
