"""Async scheduling (``--async-scheduling``): the host's work for the next step runs while the
current step's forward pass does.

``EngineCore`` keeps at most one step in flight on a ``StepPipeline`` (one worker thread that
runs the model runner's steps in order). While step N runs there, the engine core lets the
scheduler assume N's results (``Scheduler.advance``: chunks computed, one ``PLACEHOLDER_TOKEN``
per sampling sequence), schedules step N + 1, builds its inputs and submits it; only then does it
wait for N and apply N's real results (``Scheduler.update``), and the front end turns them into
text while N + 1 runs. The worker writes N's sampled ids over N + 1's placeholder rows of the
input ids tensor (``fill_placeholders``) just before N + 1's forward pass, so the host never
waits for them before submitting. On CUDA a step whose sequences each take one plain token
(greedy or sampled, no logprobs) keeps its ids on the device (``DeviceTokens``): the worker
queues N + 1 right behind N's sampling and the copy of N's ids to the host, and the engine core
reads them (``ModelOutput.resolve``) while N + 1 runs. A sequence that N finished (eos, a stop
token, max_tokens, an abort or a stop string after it) still decodes once in N + 1: that row's K/V is written to a
block it no longer owns, before any later step can run (steps run in order on the one worker),
and its result is dropped because the sequence is no longer running.

Under tensor parallelism the same pipeline drives a ``TPExecutor``: N's ids are read on the host
and written into N + 1's host-built inputs, which go to the workers from there.

Only some steps may run ahead (``runs_ahead``); the engine core falls back to the synchronous
order per step for the others, and for its whole life where ``unsupported`` names a reason.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagoda.executor.input import inputs_to_device
from pagoda.scheduler.scheduler import PLACEHOLDER_TOKEN
from pagoda.step import ModelOutput, SchedulerOutput
from pagoda.transfer import to_device

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.executor.input import LogitsPlan, ModelInput
    from pagoda.executor.model_runner import ModelRunner
    from pagoda.executor.tp_executor import TPExecutor


# Devices whose plain steps leave their ids on the device for the next step (the tests add
# "cpu" to run that path without a GPU).
DEFER_IDS_ON = ("cuda",)


def unsupported(config: EngineConfig, executor: Any, has_proposer: bool, has_kv_tiers: bool) -> str | None:
    """Why this engine cannot schedule ahead at all (None: it can). The executor must be a
    ``ModelRunner`` or a tensor-parallel ``TPExecutor`` without pipeline stages, whose steps share
    no host state with the engine core's thread."""
    from pagoda.executor.model_runner import ModelRunner
    from pagoda.executor.tp_executor import TPExecutor

    tensor_parallel = type(executor) is TPExecutor and config.parallel.pipeline_parallel_size == 1
    reasons = [
        (type(executor) is not ModelRunner and not tensor_parallel, "pipeline parallelism"),
        (has_proposer, "speculative decoding"),
        (has_kv_tiers, "KV tiers (their copies are the engine core's)"),
        (config.lora is not None, "LoRA (adapter slots load between steps)"),
        (config.model.is_multimodal, "a vision-language model (the encoder cache)"),
        (config.pooler is not None, "an embedding model"),
        (config.model.is_hybrid, "a hybrid model (its recurrent-state slots and copies)"),
    ]
    return next((why for off, why in reasons if off), None)


def runs_ahead(sched: SchedulerOutput) -> bool:
    """Whether the next step may be scheduled before ``sched``'s results are in: every sequence
    either computes a prompt chunk or samples one plain token whose sampling reads nothing the
    engine core changes meanwhile (its output tokens: penalties, a pending ``min_tokens``), and
    that needs nothing of the host afterwards but the token (no drafts, lookahead, grammar,
    prompt logprobs, pooling, or a prompt forking into ``n`` samples)."""
    if sched.is_empty:
        return False
    for item in sched.scheduled:
        seq = item.seq
        params = seq.params
        if (item.draft is not None or item.num_lookahead or item.bitmask is not None
                or seq.request.grammar is not None or params.pooling is not None
                or params.prompt_logprobs is not None):
            return False
        if item.samples and (seq.num_samples != 1 or params.needs_penalties
                             or seq.num_output_tokens < params.min_tokens):
            return False
    return True


def placeholder_rows(sched: SchedulerOutput) -> tuple[list[int], list[str]]:
    """The input rows of ``sched`` that hold a placeholder, and the sequence id whose token the
    step before samples for each. A sequence's placeholder is its last token."""
    rows: list[int] = []
    owners: list[str] = []
    first = 0
    for item in sched.scheduled:
        seq = item.seq
        if item.end == seq.num_tokens and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
            rows.append(first + item.end - 1 - item.start)
            owners.append(seq.seq_id)
        first += item.num_new_tokens
    return rows, owners


def fill_placeholders(input_ids: torch.Tensor, rows: list[int], owners: list[str], previous: ModelOutput) -> None:
    """Write the previous step's sampled ids over the placeholder ``rows`` (a sequence that got
    no token, its request failed, decodes token 0 once; its result is dropped). Ids the
    previous step left on the device (``ModelOutput.pending``) are gathered there: the host
    never waits for them."""
    device = input_ids.device
    index = to_device(torch.tensor(rows, dtype=torch.long), device)
    pending = previous.pending
    if pending is not None:
        # One zero past the step's ids stands in for an owner without a token.
        src = to_device(torch.tensor([pending.row_of.get(seq_id, len(pending.seq_ids)) for seq_id in owners],
                                     dtype=torch.long), device)
        ids = torch.cat([pending.tokens, pending.tokens.new_zeros(1)])  # already on ``device``
        input_ids.index_copy_(0, index, ids[src].to(input_ids.dtype))
        return
    tokens = []
    for seq_id in owners:
        result = previous.results.get(seq_id)
        tokens.append(result.token_ids[0] if result is not None and result.token_ids else 0)
    input_ids.index_copy_(0, index, to_device(torch.tensor(tokens, dtype=input_ids.dtype), device))


@dataclass
class InFlight:
    """A submitted step: its schedule and its result to come."""

    sched: SchedulerOutput
    future: Future[ModelOutput]


class StepPipeline:
    """Runs an executor's steps on one worker thread, in submission order. Inputs are built on
    the engine core's thread, on the host. A ``ModelRunner``'s worker moves them to the device with
    copies that do not wait for the step before it on the stream and fills the placeholders there;
    a ``TPExecutor`` (``ships_host_inputs``) has them filled on the host, where its workers get
    them from (the previous step's ids read there first: its device idles from the end of one
    forward to the launch of the next, while the engine core's own work still overlaps)."""

    def __init__(self, runner: ModelRunner | TPExecutor) -> None:
        self.runner = runner
        self._host = torch.device("cpu")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-step")
        self._on_host = getattr(runner, "ships_host_inputs", False)
        if not self._on_host:
            # Steps of one plain token per sequence hand their ids to the next step on the device
            # (``DeviceTokens``): on CUDA the next step is queued before the host has read them.
            runner.defer_ids = runner.device.type in DEFER_IDS_ON

    def submit(self, sched: SchedulerOutput, previous: InFlight | None) -> InFlight:
        """Build ``sched``'s inputs here and queue the step after ``previous`` (whose sampled ids
        fill ``sched``'s placeholders)."""
        prepared = None
        if not sched.is_empty:
            inputs, plan = self.runner.prepare(sched, self._host)
            prepared = (inputs, plan, *placeholder_rows(sched))
        before = previous.future if previous is not None else None
        return InFlight(sched, self._pool.submit(self._run, sched, prepared, before))

    def _run(self, sched: SchedulerOutput, prepared: tuple[ModelInput, LogitsPlan, list[int], list[str]] | None,
             before: Future[ModelOutput] | None) -> ModelOutput:
        runner = self.runner
        runner.begin_step(sched)
        if prepared is None:
            return ModelOutput()
        inputs, plan, rows, owners = prepared
        if not self._on_host:
            inputs = inputs_to_device(inputs, runner.device)
        if rows:
            assert before is not None, "placeholders without a step before"
            fill_placeholders(inputs.input_ids, rows, owners, before.result())  # done: steps run in order
        return runner.run_step(sched, inputs, plan)

    def shutdown(self) -> None:
        """Wait for the step in flight and stop the worker."""
        self._pool.shutdown(wait=True)
