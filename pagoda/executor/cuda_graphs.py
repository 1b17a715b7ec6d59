"""CUDA graphs for decode steps.

A decode step (one new token per sequence) launches a few hundred small kernels; at small
batch sizes the GPU finishes each one before the host has launched the next. Capturing the
forward pass and the LM head once per batch size and replaying them costs one launch per step.

Batch sizes (``capture_sizes``): 1, 2, 4, then every multiple of 8 up to the largest batch the
scheduler can form (at most ``MAX_CAPTURE_SIZE``; larger decode batches run eagerly). A batch of ``n`` sequences runs in the graph of the smallest size ``>= n``;
the rows past ``n`` are padding: token 0 at position 0, slot -1 (the K/V write skips it),
seq_len 0 (attention reads nothing and yields zeros), context 0 and a block-table row of
zeros. Nobody reads a padding row's output, and it cannot leak into real rows: every op of the
forward is row-wise except attention, which keeps sequences apart.

What a graph bakes in, and why replays stay correct:
  * tensor addresses: the step's inputs are copied into static buffers (``StaticDecodeInputs``)
    that the graph reads; the weights and the KV cache never move after capture.
  * kernel grids and constexprs: the batch size is fixed per graph, and the Triton decode
    kernel's split count is fixed at capture from ``max_model_len`` (any split count is correct
    for any sequence length; it only changes parallelism).
  * host-side metadata (``query_lens_cpu``, ``seq_lens_cpu``, ``max_seq_len``): set to capture
    constants (``[1] * size``, ``[max_model_len] * size``). The decode path branches on their
    lengths (fixed per graph) and reads lengths from device tensors only.
  * LoRA: each row's adapter as a one-hot row in a static buffer; the LoRA layers take their
    dense way (every slot's A and B, each row's own picked on the device), so any mix of
    adapters, or none, replays the same graph. Adapter loads write the stacked A/B in place.

The same code path runs without graphs (``use_graphs=False``): on CPU the tests use it to check
the padding and buffer handling against the ordinary forward.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from pagoda.distributed.parallel_state import get_pp, get_tp
from pagoda.executor.graph_inputs_kernel import load_rows
from pagoda.executor.greedy_step_kernel import greedy_step
from pagoda.executor.input import ModelInput
from pagoda.executor.interface import ModelHost
from pagoda.executor.sampler import Sampler
from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.layers.attention.context import forward_context
from pagoda.layers.fused_ops import use_triton
from pagoda.lora.layers import LoRABatch
from pagoda.transfer import to_device

logger = logging.getLogger(__name__)

PAD_SLOT = -1
# Past a few hundred sequences a decode step is long enough that launch overhead no longer
# matters, while every extra size costs capture time and pool memory: bigger batches run eagerly.
MAX_CAPTURE_SIZE = 512
STATIC_DECODE_ENV = "PAGODA_STATIC_DECODE"


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... and ``max_batch`` itself, so every
    decode batch the scheduler can form has a graph."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s <= max_batch}
    sizes.update(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return sorted(sizes)


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` sequences (None: too many)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class StaticDecodeInputs:
    """The tensors a decode graph reads, sized for the largest batch. A graph of size ``s``
    reads rows ``[0, s)``; each step overwrites them in place (``load``)."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    seq_lens: torch.Tensor  # [N] int32
    context_lens: torch.Tensor  # [N] int32
    query_start_loc: torch.Tensor  # [N + 1] int32: 0..N, one token per sequence, never changes
    block_tables: torch.Tensor  # [N, max_blocks] int32
    # LoRA engines: each row's adapter slot as a one-hot row (model dtype; zeros: no adapter).
    lora_one_hot: torch.Tensor | None = None  # [N, max_loras]
    widest: int = 0  # the widest block-table row any load wrote (columns past it are all zero)

    @staticmethod
    def allocate(max_batch: int, max_blocks: int, device: torch.device,
                 lora: tuple[int, torch.dtype] | None = None) -> "StaticDecodeInputs":
        """Buffers that hold nothing but padding (what warm-up and capture run on); ``lora``:
        (max_loras, model dtype) of a LoRA engine."""
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return StaticDecodeInputs(
            input_ids=zeros(max_batch, dtype=torch.long), positions=zeros(max_batch, dtype=torch.long),
            slot_mapping=torch.full((max_batch,), PAD_SLOT, dtype=torch.long, device=device),
            seq_lens=zeros(max_batch), context_lens=zeros(max_batch),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            block_tables=zeros(max_batch, max_blocks),
            lora_one_hot=None if lora is None else zeros(max_batch, lora[0], dtype=lora[1]))

    @property
    def max_batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_blocks(self) -> int:
        return int(self.block_tables.shape[1])

    def load(self, inputs: ModelInput, size: int) -> None:
        """Copy a decode batch of ``n <= size`` sequences into rows ``[0, n)`` and padding into
        rows ``[n, size)``. Device-to-device copies only: no host sync. With Triton on the
        buffers' device, one launch (``graph_inputs_kernel.py``), else a dozen torch ops."""
        meta = inputs.meta
        n = meta.num_seqs
        width = meta.block_tables.shape[1]
        src = (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens, meta.context_lens,
               meta.block_tables)
        dst = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.context_lens, self.block_tables)
        self.widest = max(self.widest, width)
        if use_triton(self.input_ids) and all(t.stride(-1) == 1 for t in src):
            load_rows(src, dst, n, size, self.widest, PAD_SLOT)
        else:
            for buf, values, pad in zip(dst[:5], src[:5], (0, 0, PAD_SLOT, 0, 0)):
                buf[:n].copy_(values)
                buf[n:size].fill_(pad)
            # Zero whole rows first: columns past this batch's widest table must not keep block
            # ids of an earlier step (the Triton kernel never reads them, the torch backend does).
            self.block_tables[:size].zero_()
            self.block_tables[:n, :width].copy_(meta.block_tables)
        if self.lora_one_hot is not None:
            self.lora_one_hot[:size].zero_()
            if inputs.lora_slots is not None:  # host slots -> one-hot rows, one host-to-device copy
                rows = LoRABatch.one_hot_rows(inputs.lora_slots, self.lora_one_hot.shape[1], self.lora_one_hot.dtype)
                self.lora_one_hot[:n].copy_(to_device(rows, self.lora_one_hot.device))

    def advance(self, tokens: torch.Tensor, n: int, block_size: int) -> None:
        """Move rows ``[0, n)`` on by one decode step, on the buffers' device (no host sync):
        each row's next input is its ``tokens`` entry one position later, its lengths one longer,
        its slot the block-table entry of the new position. The padding rows stay as they are.
        The table must already hold the blocks of the new positions (the scheduler allocates a
        round's blocks before it starts)."""
        self.input_ids[:n].copy_(tokens)
        positions = self.positions[:n]
        positions.add_(1)
        self.seq_lens[:n].add_(1)
        self.context_lens[:n].add_(1)
        blocks = self.block_tables[:n].gather(1, torch.div(positions, block_size, rounding_mode="floor")[:, None])
        torch.add(positions.remainder(block_size), blocks[:, 0].long(), alpha=block_size, out=self.slot_mapping[:n])

    def metadata(self, size: int, max_model_len: int) -> AttentionMetadata:
        """Attention metadata over rows ``[0, size)`` of the buffers. The host-side fields are
        capture constants, not the batch's values (see the module docstring)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], max_query_len=1, max_seq_len=max_model_len,
            query_lens_cpu=[1] * size, seq_lens_cpu=[max_model_len] * size)


class DecodeGraphs:
    """Decode forwards at fixed batch sizes through ``StaticDecodeInputs``: replayed from CUDA
    graphs, or run eagerly through the same buffers when ``use_graphs`` is False."""

    def __init__(self, runner: ModelHost, use_graphs: bool) -> None:
        if runner.kv_cache is None:
            raise RuntimeError("decode graphs need the KV cache: call allocate_kv_cache first")
        cfg = runner.config
        self.runner = runner
        self.use_graphs = use_graphs
        self.max_model_len = cfg.model.max_model_len
        sched = cfg.scheduler
        self.sizes = capture_sizes(min(sched.max_num_seqs, sched.max_num_batched_tokens, MAX_CAPTURE_SIZE))
        max_blocks = -(-self.max_model_len // runner.block_size)
        self.lora = getattr(runner, "lora", None)
        lora = None if self.lora is None else (self.lora.max_loras, cfg.model.dtype)
        self.buffers = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks, runner.device, lora)
        # A graph writes into the cache it was captured with; a reallocated cache voids them.
        self._kv_cache = runner.kv_cache
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # hidden states, logits
        # The LM head runs inside the graphs on one rank; under tensor parallelism its vocab
        # gather (a list all-gather) stays outside them, after the replay, on every rank alike.
        self.head_in_graph = get_tp().size == 1
        self.runs = 0  # steps served (replays, or static-buffer forwards without graphs)
        self.rounds = 0  # greedy multi-step rounds run on the device (``greedy_round``)

    def can_run(self, inputs: ModelInput) -> bool:
        """One new token per sequence (no prefill chunk, no drafts) and a batch that fits."""
        meta = inputs.meta
        return (meta.max_query_len == 1 and meta.num_tokens == meta.num_seqs
                and meta.num_seqs <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.buffers.max_blocks
                and self.runner.kv_cache is self._kv_cache)

    def run(self, inputs: ModelInput) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a batch ``can_run`` accepted. The tensor is the
        graph's output buffer: valid until the next ``run``."""
        return self._run(inputs)[0]

    def run_logits(self, inputs: ModelInput) -> torch.Tensor:
        """The LM head's logits ``[n, vocab]`` of a batch ``can_run`` accepted, one row per
        sequence: the head is part of the graph (``head_in_graph``: no eager launch after the
        replay), else run on the graph's hidden states. Valid until the next run."""
        hidden, logits = self._run(inputs)
        return logits if logits is not None else self.runner.model.compute_logits(hidden)

    def serves_round(self, inputs: ModelInput) -> bool:
        """Whether ``greedy_round`` can run a round from ``inputs``: a batch ``can_run`` accepts,
        one position per token (not M-RoPE's three rows), the LM head inside the graphs."""
        return self.head_in_graph and inputs.positions.dim() == 1 and self.can_run(inputs)

    @torch.inference_mode()
    def greedy_round(self, inputs: ModelInput, steps: int, ends: list[frozenset[int]],
                     stop: Callable[[], bool] | None = None) -> list[list[int]]:
        """Up to ``steps`` greedy decode steps of the batch ``inputs`` (``serves_round``), each
        fed the previous step's argmax on the device: the buffers are moved on in place
        (``StaticDecodeInputs.advance``) and the host reads every step's ids once, at the end, so
        it only launches, running ahead of the device. Before each step after the first,
        ``stop()`` may end the round (work arrived, a background step given up); a row's list
        ends at its first token in ``ends``. Each token is the argmax of its row's finite
        logits, as a plain greedy step samples it."""
        n = inputs.meta.num_seqs
        size = padded_size(n, self.sizes)
        assert size is not None, "greedy_round() called on a batch serves_round() refuses"
        self.buffers.load(inputs, size)
        block_size = self.runner.block_size
        # With Triton on the buffers' device each step's argmax and the move to the next step are
        # two launches (greedy_step_kernel.py); the torch way is about a dozen.
        fused = use_triton(self.buffers.input_ids)
        tokens = torch.empty((steps, n), dtype=torch.long, device=self.buffers.input_ids.device)
        done = 0
        for step in range(steps):
            if step:
                if stop is not None and stop():
                    break
                if not fused:
                    self.buffers.advance(tokens[step - 1], n, block_size)
            self.runs += 1
            if self.use_graphs:
                self._graphs[size].replay()
                logits = self._outputs[size][1]
            else:
                logits = self._forward(size)[1]
            if fused:
                greedy_step(logits[:n], tokens[step], self.buffers, block_size, step + 1 < steps, PAD_SLOT)
            else:
                tokens[step].copy_(Sampler.greedy_on_device(logits[:n], list(range(n))))
            done += 1
        self.rounds += 1
        rows = tokens[:done].T.tolist()
        for row, end in zip(rows, ends):
            stop_at = next((i for i, t in enumerate(row) if t in end), None)
            if stop_at is not None:
                del row[stop_at + 1:]
        return rows

    @torch.inference_mode()
    def _run(self, inputs: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = inputs.meta.num_seqs
        size = padded_size(n, self.sizes)
        assert size is not None, "run() called on a batch can_run() refuses"
        self.buffers.load(inputs, size)
        self.runs += 1
        if self.use_graphs:
            self._graphs[size].replay()
            hidden, logits = self._outputs[size]
        else:
            hidden, logits = self._forward(size)
        return hidden[:n], None if logits is None else logits[:n]

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states and (``head_in_graph``) logits of the ``size`` rows of the buffers."""
        b = self.buffers
        # A LoRA engine's graphs hold every layer's delta in the dense way (``lora/layers.py``):
        # a step without adapter rows replays them with zero one-hot rows.
        lora = self.lora.dense_batch(b.lora_one_hot[:size]) if self.lora is not None else contextlib.nullcontext()
        with forward_context(b.metadata(size, self.max_model_len)), self._fixed_splits(size), lora:
            hidden = self.runner.model(b.input_ids[:size], b.positions[:size])
        return hidden, self.runner.model.compute_logits(hidden) if self.head_in_graph else None

    @contextmanager
    def _fixed_splits(self, size: int) -> Iterator[None]:
        """Pin the Triton decode kernel's split count for this size (from ``max_model_len``,
        the longest context a replay can see), then restore the backend's own setting so eager
        steps keep choosing per batch."""
        layer = self.runner.model.attention_layers()[0]
        backend = layer.backend
        # Only the Triton backend splits; a count someone fixed already is left alone.
        if not hasattr(backend, "decode_num_splits") or backend.decode_num_splits is not None:
            yield
            return
        from pagoda.layers.attention import triton_kernels as tk

        # Programs a sequence's decode spreads over: its KV heads, or an MLA layer's head tiles.
        programs = getattr(layer, "decode_programs", layer.num_kv_heads)
        backend.decode_num_splits = tk.choose_num_splits(
            size, programs, self.max_model_len, tk._device_sm_count(self.runner.device))
        try:
            yield
        finally:
            backend.decode_num_splits = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool: the graphs run one
        at a time, so each smaller graph reuses the larger ones' intermediate memory."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))  # the buffers' zeros
        for size in reversed(self.sizes):
            # Warm-up on the capture stream, outside capture: compiles the Triton kernels and
            # sets up per-stream library state (cuBLAS workspaces), none of which may happen
            # while the stream is being captured.
            with torch.cuda.stream(stream):
                self._forward(size)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._outputs[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.runner.device)


def capture_decode_graphs(runner: ModelHost) -> DecodeGraphs | None:
    """Capture decode graphs for ``runner``, or None where they do not apply: CPU,
    ``enforce_eager``, pipeline stages (their micro-batches run ``pipeline.run_stage``).
    Tensor-parallel ranks each call this at the same time (``TPExecutor.capture_cuda_graphs``):
    they capture the same sizes in the same order, the all-reduces of the warm-up forwards meet,
    and each graph holds its rank's all-reduces; every rank replays the same size each step
    because each decides from the same shipped inputs.

    ``PAGODA_STATIC_DECODE=1`` (tests, debugging) runs decode steps through the same static
    buffers and padding without capture on any device, tensor-parallel ranks included."""
    if os.environ.get(STATIC_DECODE_ENV) == "1" and not runner.config.enforce_eager and get_pp().size == 1:
        return DecodeGraphs(runner, use_graphs=False)
    if runner.device.type != "cuda" or runner.config.enforce_eager or get_pp().size > 1:
        return None
    if not getattr(runner.model, "cuda_graph_safe", True):  # e.g. MoE: per-step host sync on expert counts
        logger.info("%s runs decode without CUDA graphs", type(runner.model).__name__)
        return None
    graphs = DecodeGraphs(runner, use_graphs=True)
    free_before, _ = torch.cuda.mem_get_info(runner.device)
    start = time.perf_counter()
    try:
        graphs.capture()
    except RuntimeError as exc:  # a layer the card cannot capture costs the graphs, not the engine
        logger.warning("decode CUDA graph capture of %s failed (%s); decode runs eagerly",
                       type(runner.model).__name__, exc)
        return None
    free_after, _ = torch.cuda.mem_get_info(runner.device)
    logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.2fs using %.0f MiB",
                len(graphs.sizes), graphs.sizes[0], graphs.sizes[-1], time.perf_counter() - start,
                (free_before - free_after) / 2**20)
    return graphs
