"""Pipeline-parallel steps: the micro-batches of a step and what one stage does with them.

Every rank receives the whole step's inputs from the engine core (``tp_worker.StepChannel``)
and cuts them into the same micro-batches: contiguous runs of the step's tokens of equal size,
as many as there are stages (fewer when the step has fewer tokens). A cut may fall inside a
prompt chunk: its second part is then a later chunk of the same sequence, which attends to the
first part's K/V, written by the same stage one micro-batch earlier. Each stage then
works through the micro-batches in order: receive micro-batch ``m``'s hidden states and
residual from the previous stage, run its own layers, start sending them to the next stage,
go on with ``m + 1``. So while stage ``s`` runs micro-batch ``m``, stage ``s + 1`` runs
``m - 1``. The last stage turns each micro-batch's hidden rows into logits; concatenated in
micro-batch order they are exactly the logits rows of the whole step, which rank 0 (the last
stage's first tensor-parallel rank, the engine core) samples with the one sampling pipeline.

``StageTimes`` keeps what the benchmarks print: per stage the step time and the time spent
waiting for input from the previous stage (the pipeline bubble).
"""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

import torch

from pagoda.distributed.parallel_state import get_pp, pp_irecv, pp_isend
from pagoda.executor.input import ModelInput
from pagoda.layers.attention.backend import AttentionMetadata


def micro_batch_bounds(num_tokens: int, num_micro_batches: int) -> list[tuple[int, int]]:
    """Token ranges ``[t0, t1)`` cutting a step of ``num_tokens`` tokens into at most
    ``num_micro_batches`` contiguous, non-empty runs of equal size (to within a token)."""
    count = max(1, min(num_micro_batches, num_tokens))
    cuts = [num_tokens * k // count for k in range(count + 1)]
    return list(zip(cuts, cuts[1:]))


def slice_model_input(inputs: ModelInput, t0: int, t1: int, logits_rows: torch.Tensor) -> ModelInput:
    """Tokens ``[t0, t1)`` of a step as a step of their own (``logits_rows``: the step's logits
    indices on the host, ascending). A sequence cut at ``t0`` continues from the tokens before
    the cut as context (they are in the cache by then); one cut at ``t1`` ends there."""
    m = inputs.meta
    starts = m.query_start_loc_cpu
    a, b = bisect.bisect_right(starts, t0) - 1, bisect.bisect_left(starts, t1)  # sequences [a, b) meet the range
    q_lens, ctx = [], []
    for i in range(a, b):
        first, end = max(starts[i], t0), min(starts[i + 1], t1)
        q_lens.append(end - first)
        ctx.append(m.context_lens_cpu[i] + first - starts[i])
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    qsl = [0, *itertools.accumulate(q_lens)]
    dev = inputs.input_ids.device
    lo, hi = (int(i) for i in torch.searchsorted(logits_rows, torch.tensor([t0, t1])))
    meta = AttentionMetadata(
        slot_mapping=m.slot_mapping[t0:t1], query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev), block_tables=m.block_tables[a:b],
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        query_start_loc_cpu=qsl, context_lens_cpu=ctx)
    lora = inputs.lora_slots[t0:t1] if inputs.lora_slots is not None else None
    return ModelInput(inputs.input_ids[t0:t1], inputs.positions[t0:t1], meta,
                      (logits_rows[lo:hi] - t0).to(dev), lora)


def split_micro_batches(inputs: ModelInput, num_micro_batches: int) -> list[ModelInput]:
    bounds = micro_batch_bounds(int(inputs.input_ids.numel()), num_micro_batches)
    if len(bounds) == 1:
        return [inputs]
    rows = inputs.logits_indices.cpu()
    return [slice_model_input(inputs, t0, t1, rows) for t0, t1 in bounds]


@dataclass
class StageTimes:
    """Running totals of one rank's pipeline steps (seconds)."""

    steps: int = 0
    micro_batches: int = 0
    step_s: float = 0.0  # from having the step's inputs to having sent (or scored) the last micro-batch
    wait_s: float = 0.0  # of that, blocked waiting for the previous stage's hidden states

    def values(self) -> list[float]:
        return [float(self.steps), float(self.micro_batches), self.step_s, self.wait_s]

    def reset(self) -> None:
        self.steps, self.micro_batches, self.step_s, self.wait_s = 0, 0, 0.0, 0.0


@dataclass(frozen=True)
class StageStats:
    """One stage's figures over the steps since the last reset (its first tensor-parallel rank)."""

    stage: int
    steps: int
    micro_batches: int
    step_ms: float  # mean per step
    wait_ms: float  # mean per step

    @property
    def bubble(self) -> float:
        """The fraction of the stage's step time it waited for its input."""
        return self.wait_ms / self.step_ms if self.step_ms > 0 else 0.0


def stage_stats(per_rank: list[list[float]], pipeline_size: int, tp_size: int) -> list[StageStats]:
    """``StageStats`` per stage, first stage first, from every rank's ``StageTimes.values()``
    (world-rank order; ranks are numbered from the last stage back)."""
    out = []
    for stage in range(pipeline_size):
        steps, mbs, step_s, wait_s = per_rank[(pipeline_size - 1 - stage) * tp_size]
        n = max(steps, 1)
        out.append(StageStats(stage, int(steps), int(mbs), step_s / n * 1e3, wait_s / n * 1e3))
    return out


@torch.inference_mode()
def run_stage(runner, inputs: ModelInput, times: StageTimes | None = None) -> torch.Tensor | None:
    """This rank's part of a pipelined forward pass (``runner``: a ``ModelRunner`` holding this
    stage's layers). Returns the step's logits on the last stage, None on the others."""
    start = time.perf_counter()
    pp = get_pp()
    cfg = runner.config.model
    micro = split_micro_batches(inputs, pp.size)
    recvs: list[tuple[torch.Tensor, object]] = []
    if not pp.is_first:  # post every receive at once: transfers overlap this stage's compute
        for m, mb in enumerate(micro):
            buf = torch.empty(2, mb.input_ids.numel(), cfg.hidden_size, dtype=cfg.dtype, device=runner.device)
            recvs.append((buf, pp_irecv(buf, pp.rank - 1, tag=m)))
    sends, logits = [], []
    waited = 0.0
    for m, mb in enumerate(micro):
        intermediate = None
        if recvs:
            buf, work = recvs[m]
            t = time.perf_counter()
            work.wait()
            waited += time.perf_counter() - t
            intermediate = (buf[0], buf[1])
        out = runner.forward(mb, intermediate)
        if pp.is_last:
            if mb.logits_indices.numel():  # the same on every rank of the stage (the LM head gathers)
                logits.append(runner.model.compute_logits(out[mb.logits_indices]))
        else:
            packed = torch.stack(out)
            sends.append((packed, pp_isend(packed, pp.rank + 1, tag=m)))
    for _, work in sends:
        work.wait()  # type: ignore[attr-defined]
    if times is not None:
        times.steps += 1
        times.micro_batches += len(micro)
        times.step_s += time.perf_counter() - start
        times.wait_s += waited
    if not pp.is_last:
        return None
    if not logits:
        return torch.empty(0, cfg.vocab_size, dtype=cfg.dtype, device=runner.device)
    return torch.cat(logits)
