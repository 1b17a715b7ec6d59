"""How many bytes of GPU memory the KV cache may take.

``gpu_memory_utilization`` caps what the whole device may hold while pagoda runs. After the
weights are loaded, one dummy step at the largest shape the scheduler can produce
(``max_num_batched_tokens`` tokens over up to ``max_num_seqs`` sequences, the LM head on one
row per sequence, and the sampler on those rows with its most memory-hungry options) measures
the peak of torch's allocator; ``torch.cuda.mem_get_info`` gives what the device holds outside
torch (CUDA context, library workspaces, NCCL buffers, other processes). The KV cache gets the
rest::

    budget = total * utilization - (weights + peak activations + non-torch memory)

Not counted: the decode CUDA graphs' pool (captured after the cache is allocated; small, as
decode batches are small: the largest graph's logits, 512 rows of the vocabulary at most, are
its biggest part, and it comes out of the ``1 - utilization`` headroom), prompt
logprobs over whole long chunks (logits for every prompt row), and speculative decoding's
extra logits rows.
"""
from __future__ import annotations

import itertools
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from pagoda.executor.input import build_model_input
from pagoda.executor.interface import ModelHost
from pagoda.executor.sampler import SampleRow
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GiB = float(2**30)


def kv_budget(total: int, utilization: float, weights: int, peak_activation: int, non_torch: int) -> int:
    """Bytes left for the KV cache (negative when the rest does not even fit)."""
    return int(total * utilization) - (weights + peak_activation + non_torch)


@dataclass(frozen=True)
class MemoryProfile:
    """What the profile measured, in bytes."""

    total: int
    utilization: float
    weights: int
    peak_activation: int
    non_torch: int

    @property
    def budget(self) -> int:
        return kv_budget(self.total, self.utilization, self.weights, self.peak_activation, self.non_torch)

    def describe(self) -> str:
        return (f"{self.utilization:.2f} x {self.total / GiB:.2f} GiB total = "
                f"{self.total * self.utilization / GiB:.2f} GiB for pagoda; weights {self.weights / GiB:.2f} GiB, "
                f"peak activations {self.peak_activation / GiB:.2f} GiB, outside torch "
                f"{self.non_torch / GiB:.2f} GiB; KV cache budget {self.budget / GiB:.2f} GiB")


def blocks_for(profile: MemoryProfile, bytes_per_block: int, block_size: int, max_model_len: int,
               max_num_batched_tokens: int) -> int:
    """KV-cache blocks the budget buys; an error naming the numbers and the remedies when that
    is not even one sequence of ``max_model_len`` tokens."""
    blocks = max(profile.budget, 0) // bytes_per_block
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(
            f"not enough GPU memory for the KV cache: {profile.describe()}; that is {blocks} blocks of "
            f"{block_size} tokens, but one sequence of max_model_len {max_model_len} needs {needed} blocks "
            f"({needed * bytes_per_block / GiB:.2f} GiB). Raise --gpu-memory-utilization, lower "
            f"--max-model-len, lower --max-num-batched-tokens (now {max_num_batched_tokens}; it sets the "
            f"activation peak), free the GPU of other processes, or set --kv-cache-memory explicitly")
    return blocks


def profile_kv_budget(runner: ModelHost) -> int:
    """Bytes the KV cache may take on ``runner``'s GPU (weights must be loaded, no cache yet).
    Raises ``ValueError`` when that is less than one ``max_model_len`` sequence needs."""
    profile = measure(runner)
    cfg = runner.config
    logger.info("GPU memory: %s", profile.describe())
    blocks_for(profile, runner.kv_bytes_per_block(), runner.block_size, cfg.model.max_model_len,
               cfg.scheduler.max_num_batched_tokens)
    return profile.budget


def measure(runner: ModelHost) -> MemoryProfile:
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        with _temporary_kv_cache(runner):
            _dummy_step(runner)
    except torch.cuda.OutOfMemoryError as exc:
        sched = runner.config.scheduler
        raise RuntimeError(
            f"the GPU ran out of memory in a step of max_num_batched_tokens {sched.max_num_batched_tokens} "
            f"tokens over max_num_seqs {sched.max_num_seqs} sequences, before any KV cache was allocated: "
            f"lower --max-num-batched-tokens or --max-num-seqs, or free the GPU") from exc
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Everything the device holds that torch's caching allocator did not reserve.
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    torch.cuda.empty_cache()  # hand the activations' blocks back (the draft model sizes by free memory)
    return MemoryProfile(total, runner.config.cache.gpu_memory_utilization, weights, peak - weights, non_torch)


@contextmanager
def _temporary_kv_cache(runner: ModelHost) -> Iterator[None]:
    """A one-block cache for the dummy step: every sequence's block table points at block 0, so
    attention and K/V writes run at full size on a cache of a few kilobytes."""
    layers = runner.model.attention_layers()
    saved = runner.kv_cache, [(layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale) for layer in layers]
    saved_scales = runner.kv_scales
    runner.allocate_kv_cache(1)
    assert runner.kv_cache is not None
    runner.kv_cache.zero_()  # the dummy step reads it: keep NaN out of the sampler
    try:
        yield
    finally:
        runner.kv_cache = saved[0]
        runner.kv_scales = saved_scales
        for layer, (k, v, ks, vs) in zip(layers, saved[1]):
            layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = k, v, ks, vs


def dummy_shape(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Query lengths of the profiling step: the token budget spread over as many sequences as
    the scheduler allows, none longer than ``max_model_len``."""
    tokens = max_num_batched_tokens
    seqs = max(min(max_num_seqs, tokens), -(-tokens // max_model_len))
    base, extra = divmod(tokens, seqs)
    return [base + 1] * extra + [base] * (seqs - extra)


# The sampler's heaviest path: penalties (token counts), top-k/top-p (a sort of the whole
# vocabulary), min-p and logprobs each take [rows, vocab] fp32 buffers.
_HEAVY_PARAMS = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                               frequency_penalty=0.1, logprobs=20)


@torch.inference_mode()
def _dummy_step(runner: ModelHost) -> None:
    cfg = runner.config
    q_lens = dummy_shape(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs, cfg.model.max_model_len)
    tables = [[0] * -(-n // runner.block_size) for n in q_lens]
    last_rows = [end - 1 for end in itertools.accumulate(q_lens)]
    inputs = build_model_input([0] * sum(q_lens), q_lens, q_lens, tables, last_rows, runner.device, runner.block_size)
    slots = getattr(runner, "num_state_slots", 0)
    if slots:  # a hybrid's Mamba layers: a state slot per sequence
        inputs.meta.state_slots = [i % slots for i in range(len(q_lens))]
    stage = runner.model.model  # under pipeline parallelism: only this stage's layers
    intermediate = None
    if not stage.is_first:
        zeros = torch.zeros(2, sum(q_lens), cfg.model.hidden_size, dtype=cfg.model.dtype, device=runner.device)
        intermediate = (zeros[0], zeros[1])
    hidden = runner.forward(inputs, intermediate)
    if not stage.is_last:
        return
    logits = runner.model.compute_logits(hidden[inputs.logits_indices])
    rows = [SampleRow(_HEAVY_PARAMS, None, [0], [0], ()) for _ in last_rows]
    runner.sampler(logits, rows)
