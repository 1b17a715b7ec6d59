"""Tensor-parallel workers (ranks 1..N-1) and the channel rank 0 drives them through.

Rank 0 owns the scheduler. Every message it sends is a fixed-size int64 header, broadcast over
the host (gloo) group, followed for a step by one flat int64 buffer holding all of the step's
input tensors. Workers rebuild the same ``ModelInput`` and run the same forward, so every
collective inside the model lines up across ranks; only rank 0 samples.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass

import msgspec
import torch

from pagoda.config import EngineConfig
from pagoda.cpu_quota import usable_cpus
from pagoda.distributed.parallel_state import (destroy_tensor_parallel, get_pp, get_store, host_all_gather,
                                               host_all_reduce_min, host_broadcast, init_tensor_parallel)
from pagoda.executor.input import ModelInput
from pagoda.executor.model_runner import ModelRunner
from pagoda.executor.pipeline import StageTimes, run_stage
from pagoda.executor.tp_protocol import WorkerArgs, check_same_engine
from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.lora.request import LoRARequest
from pagoda.transfer import to_device

# A worker waiting for the next step waits as long as the engine idles (ten years: no practical
# limit); only the collectives inside a step are bounded by the group's timeout.
IDLE_WAIT_S = 10 * 365 * 24 * 3600.0
# Loading weights may take long and at different speeds per rank; dead workers are caught by
# rank 0's liveness checks, so this only bounds a live but stuck one.
LOAD_TIMEOUT_S = 3600.0
PARENT_POLL_S = 1.0


class Command(enum.IntEnum):
    STEP = 1
    DETERMINE_NUM_BLOCKS = 2
    ALLOCATE_KV_CACHE = 3
    SHUTDOWN = 4
    LORA_PLACE = 5  # argument: the slot; payload: the adapter (msgpack LoRARequest)
    LORA_REMOVE = 6  # argument: the adapter id
    STAGE_TIMES = 7  # every rank's ``StageTimes`` gathered; argument 1: then reset them
    KV_ATTACH = 8  # every rank builds its ``ShardedKVCodec`` (the KV tiers)
    KV_TRANSFER = 9  # payload: ``ShardedKVCodec.encode``d tier copies, done before the next step
    CAPTURE_GRAPHS = 10  # every rank captures its decode CUDA graphs (``capture_graphs_together``)


# header: command, argument, then the step's shape (tokens, sequences, block-table width,
# logits rows, block copies)
HEADER_LEN = 7


@dataclass(frozen=True)
class StepShape:
    num_tokens: int = 0
    num_seqs: int = 0
    table_width: int = 0
    num_logits: int = 0
    num_copies: int = 0

    @staticmethod
    def of(inputs: ModelInput | None, num_copies: int) -> "StepShape":
        if inputs is None:
            return StepShape(num_copies=num_copies)
        tables = inputs.meta.block_tables
        return StepShape(int(inputs.input_ids.numel()), int(tables.shape[0]), int(tables.shape[1]),
                         int(inputs.logits_indices.numel()), num_copies)

    def fields(self) -> list[int]:
        return [self.num_tokens, self.num_seqs, self.table_width, self.num_logits, self.num_copies]

    def sizes(self) -> list[int]:
        """Lengths of the payload's pieces, in ``_PIECES`` order."""
        t, b = self.num_tokens, self.num_seqs
        return [t, t, t, b + 1 if b else 0, b, b, b * self.table_width, self.num_logits, 2 * self.num_copies, t]


# Payload pieces and the dtype each has in ``ModelInput`` / ``AttentionMetadata``.
_PIECES: tuple[tuple[str, torch.dtype], ...] = (
    ("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
    ("query_start_loc", torch.int32), ("seq_lens", torch.int32), ("context_lens", torch.int32),
    ("block_tables", torch.int32), ("logits_indices", torch.int64), ("copies", torch.int64),
    ("lora_slots", torch.int64),  # -1 on every row when the step has no adapter
)


def pack_step(inputs: ModelInput | None, copies: list[tuple[int, int]]) -> tuple[StepShape, torch.Tensor]:
    """The step's tensors as one flat int64 host buffer (rank 0 builds steps on the host, so no
    copy from the device; a multimodal step's come back in one copy)."""
    shape = StepShape.of(inputs, len(copies))
    copy_pairs = torch.tensor(copies, dtype=torch.int64).reshape(-1)
    if inputs is None:
        return shape, copy_pairs
    m = inputs.meta
    tensors = [inputs.input_ids, inputs.positions, m.slot_mapping, m.query_start_loc, m.seq_lens,
               m.context_lens, m.block_tables, inputs.logits_indices]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).cpu()
    lora = inputs.lora_slots if inputs.lora_slots is not None else torch.full((shape.num_tokens,), -1)
    return shape, torch.cat([flat, copy_pairs, lora.to(torch.int64)])


def unpack_step(shape: StepShape, flat: torch.Tensor,
                device: torch.device) -> tuple[ModelInput | None, list[tuple[int, int]]]:
    pieces = dict(zip((name for name, _ in _PIECES), flat.split(shape.sizes())))
    copies = [(src, dst) for src, dst in pieces["copies"].reshape(-1, 2).tolist()]
    if shape.num_seqs == 0:
        return None, copies
    lora_slots = pieces["lora_slots"].clone() if bool((pieces["lora_slots"] >= 0).any()) else None
    starts, seq_lens, ctx = (pieces[name].tolist() for name in ("query_start_loc", "seq_lens", "context_lens"))
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    # One copy to the device for all pieces (cut and cast there), sent without waiting.
    moved = to_device(flat, torch.device(device))
    on_device = pieces if moved is flat else dict(zip(pieces, moved.split(shape.sizes())))
    dev = {name: on_device[name].to(dtype) for name, dtype in _PIECES if name != "lora_slots"}
    meta = AttentionMetadata(
        slot_mapping=dev["slot_mapping"], query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
        context_lens=dev["context_lens"],
        block_tables=dev["block_tables"].reshape(shape.num_seqs, shape.table_width),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens, query_start_loc_cpu=starts, context_lens_cpu=ctx)
    return ModelInput(dev["input_ids"], dev["positions"], meta, dev["logits_indices"], lora_slots), copies


@dataclass
class Message:
    command: Command
    argument: int = 0
    inputs: ModelInput | None = None
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    payload: bytes = b""


_BYTE_COMMANDS = (Command.LORA_PLACE, Command.LORA_REMOVE, Command.KV_TRANSFER)


class StepChannel:
    """Rank 0 -> workers, over ``torch.distributed`` broadcasts on the host group."""

    def send(self, command: Command, argument: int = 0, inputs: ModelInput | None = None,
             copies: list[tuple[int, int]] | None = None) -> None:
        shape, flat = pack_step(inputs, copies or [])
        header = torch.tensor([int(command), argument] + shape.fields(), dtype=torch.int64)
        host_broadcast(header)
        if flat.numel():
            host_broadcast(flat)

    def send_bytes(self, command: Command, argument: int, payload: bytes) -> None:
        """A control message with a byte payload (its length in the header's first shape field)."""
        header = torch.tensor([int(command), argument, len(payload), 0, 0, 0, 0], dtype=torch.int64)
        host_broadcast(header)
        if payload:
            host_broadcast(torch.frombuffer(bytearray(payload.ljust(-(-len(payload) // 8) * 8, b"\0")),
                                            dtype=torch.int64))

    def receive(self, device: torch.device) -> Message:
        header = host_broadcast(torch.empty(HEADER_LEN, dtype=torch.int64), timeout_s=IDLE_WAIT_S).tolist()
        command, argument, shape = Command(header[0]), header[1], StepShape(*header[2:])
        if command in _BYTE_COMMANDS:
            size = header[2]
            buf = host_broadcast(torch.empty(-(-size // 8), dtype=torch.int64)) if size else torch.empty(0)
            return Message(command, argument, payload=buf.numpy().tobytes()[:size])
        total = sum(shape.sizes())
        if not total:
            return Message(command, argument)
        flat = host_broadcast(torch.empty(total, dtype=torch.int64))
        inputs, copies = unpack_step(shape, flat, device)
        return Message(command, argument, inputs, copies)


@torch.inference_mode()
def run_step(runner: ModelRunner, inputs: ModelInput | None, copies: list[tuple[int, int]],
             times: StageTimes | None = None) -> torch.Tensor | None:
    """What every rank does with a step: block copies, forward, logits (the LM head gathers the
    vocab slices, so every rank must take part even though only rank 0 samples). With pipeline
    stages: this stage's part of the micro-batched forward (``pipeline.run_stage``)."""
    runner.copy_blocks(copies)
    if inputs is None:
        return None
    if get_pp().size > 1:
        return run_stage(runner, inputs, times)
    if inputs.logits_indices.numel() == 0:  # a mid-prompt chunk: nothing to score, on every rank
        hidden = runner.forward(inputs)
        return hidden.new_empty(0, runner.config.model.vocab_size)
    return runner.step_logits(inputs)


def capture_graphs_together(runner: ModelRunner) -> None:
    """Every rank at once (rank 0 after sending ``CAPTURE_GRAPHS``): capture this rank's decode
    graphs, then keep them only if every rank has its own (a rank whose capture failed runs
    eagerly, and all ranks must take the same path each step)."""
    runner.capture_cuda_graphs()
    if host_all_reduce_min(int(runner.decode_graphs is not None)) == 0:
        runner.decode_graphs = None


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the cores this process may use (``cpu_quota.usable_cpus``: its affinity
    mask and cgroup quota); more threads than that only adds contention."""
    return max(1, usable_cpus() // size)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    if config.device.startswith("cuda"):  # one GPU per rank of this node
        return dataclasses.replace(config, device=f"cuda:{config.parallel.local_rank(rank)}")
    return config


# ---- the worker process -------------------------------------------------------------------

def main() -> None:
    """Entry point of a worker process: ``python -c "from pagoda.executor.tp_worker import main; main()"``."""
    run_worker(pickle.load(sys.stdin.buffer))


def run_worker(args: WorkerArgs) -> None:
    """Join the group, load this rank's slice, then obey rank 0 until it says shut down (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    _exit_with_parent(args.parent_pid)
    config = rank_config(args.config, args.rank)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(config.parallel.local_rank(args.rank))
    else:
        torch.set_num_threads(cpu_threads_per_rank(config.parallel.ranks_per_node))
    try:
        init_tensor_parallel(args.rank, args.size, args.init_method, args.backend, args.timeout_s,
                             config.parallel.pipeline_parallel_size, args.connect_timeout_s)
        check_same_engine(get_store(), config, args.rank)
        runner = ModelRunner(config)
        host_all_reduce_min(0, LOAD_TIMEOUT_S)  # tell rank 0 this rank has loaded
        _serve(runner)
    except Exception:
        if _parent_gone(args.parent_pid):
            os._exit(1)  # rank 0 is gone; its error is the one worth reading
        raise
    finally:
        destroy_tensor_parallel()


def _serve(runner: ModelRunner) -> None:
    from pagoda.executor.kv_offload import KVBlockCodec, ShardedKVCodec

    channel = StepChannel()
    times = StageTimes()
    kv: ShardedKVCodec | None = None  # this rank's share of the KV tiers' copies
    while True:
        msg = channel.receive(runner.device)
        if msg.command == Command.SHUTDOWN:
            return
        if msg.command == Command.STEP:
            run_step(runner, msg.inputs, msg.copies, times)
        elif msg.command == Command.STAGE_TIMES:
            host_all_gather(times.values())
            if msg.argument:
                times.reset()
        elif msg.command == Command.DETERMINE_NUM_BLOCKS:
            host_all_reduce_min(runner.determine_num_blocks())
        elif msg.command == Command.ALLOCATE_KV_CACHE:
            runner.allocate_kv_cache(msg.argument)
        elif msg.command == Command.LORA_PLACE:
            runner.lora.place(msg.argument, msgspec.msgpack.decode(msg.payload, type=LoRARequest))
        elif msg.command == Command.LORA_REMOVE:
            runner.remove_lora(msg.argument)
        elif msg.command == Command.CAPTURE_GRAPHS:
            capture_graphs_together(runner)
        elif msg.command == Command.KV_ATTACH:
            kv = ShardedKVCodec(KVBlockCodec(runner.kv_cache, runner.kv_scales, None))
        elif msg.command == Command.KV_TRANSFER:
            if kv is None:  # rank 0 waits in the gather: fail loudly rather than leave it hanging
                raise RuntimeError("KV tier copies before the KV tiers were attached")
            kv.run(msg.payload)


def _parent_gone(parent_pid: int, wait_s: float = PARENT_POLL_S) -> bool:
    """Whether rank 0's process has ended; a broken connection may be noticed a moment before
    the worker is re-parented, hence the short wait."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _exit_with_parent(parent_pid: int) -> None:
    """A worker must not outlive the engine process, even when that one is killed outright."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="pagoda-tp-parent-watch", daemon=True).start()
