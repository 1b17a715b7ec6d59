"""Turns a scheduled batch into tensors, runs the model and samples.

``execute(SchedulerOutput) -> ModelOutput`` is the whole contract with the engine. Building the
inputs is vectorised with torch (positions and slot mapping come from index arithmetic, not a
Python loop per token).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.config import CPU_DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagoda.distributed.parallel_state import get_tp
from pagoda.executor.cuda_graphs import DecodeGraphs, capture_decode_graphs
from pagoda.executor.isolation import describe, run_rows
from pagoda.executor.output import ModelOutput, SeqStepResult
from pagoda.executor.sampler import SampleRow, Sampler, SamplerOutput, prompt_logprobs
from pagoda.layers import cpu_gemm
from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.layers.attention.context import forward_context
from pagoda.models.loader import load_model
from pagoda.request import Sequence
from pagoda.scheduler.output import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from pagoda.spec_decode.rejection import DraftRow, Verdict

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    """The tensors of one forward pass (what tensor-parallel workers receive)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need logits


def make_attention_backend(device: str):
    if device.startswith("cuda"):
        from pagoda.layers.attention.triton_kernels import TritonAttentionBackend

        return TritonAttentionBackend()
    from pagoda.layers.attention import cpu_kernel
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend

    cpu_kernel.load()  # compiled once per machine, at start-up rather than mid-request
    return TorchAttentionBackend()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        self.model = load_model(config.model, make_attention_backend(config.device), config.device)
        if self.device.type == "cpu":
            cpu_gemm.pack_model(self.model)
        logger.info("loaded %s (%.1fM parameters, %s) in %.2fs", config.model.path,
                    config.model.num_params / 1e6, config.model.dtype, time.perf_counter() - start)
        self.sampler = Sampler(config.seed)
        self.kv_cache: torch.Tensor | None = None
        self.decode_graphs: DecodeGraphs | None = None

    # ---- KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        heads = layers[0].num_kv_heads
        elem = torch.empty(0, dtype=self.config.cache.kv_cache_dtype).element_size()
        return 2 * len(layers) * self.block_size * heads * self.config.model.head_dim * elem

    def determine_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory
        if budget is None:
            budget = self._profile_gpu_budget() if self.device.type == "cuda" else CPU_DEFAULT_KV_CACHE_MEMORY
        return int(budget // self.kv_bytes_per_block())

    def _profile_gpu_budget(self) -> int:
        from pagoda.executor.gpu_profile import profile_kv_budget

        return profile_kv_budget(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        shape = (len(layers), 2, num_blocks, self.block_size, layers[0].num_kv_heads, self.config.model.head_dim)
        # Zeroed once: slots past a sequence's end are masked, but a masked NaN still poisons
        # attention (0 * NaN), so stale slots must only ever hold finite values.
        self.kv_cache = torch.zeros(shape, dtype=self.config.cache.kv_cache_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    def capture_cuda_graphs(self) -> None:
        """Capture decode CUDA graphs (CUDA only, unless ``enforce_eager``); call once, after
        the final ``allocate_kv_cache``."""
        self.decode_graphs = capture_decode_graphs(self)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies and self.kv_cache is not None:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # ---- one step ------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.copy_blocks(sched.block_copies)
        if sched.is_empty:
            return ModelOutput()
        inputs, plan = self.prepare(sched)
        graphs = self.decode_graphs
        hidden = graphs.run(inputs) if graphs is not None and graphs.can_run(inputs) else self.forward(inputs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sample(plan, logits)

    @torch.inference_mode()
    def forward(self, inputs: ModelInput) -> torch.Tensor:
        with forward_context(inputs.meta):
            return self.model(inputs.input_ids, inputs.positions)

    def prepare(self, sched: SchedulerOutput) -> tuple[ModelInput, "_LogitsPlan"]:
        ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        plan = _LogitsPlan()
        for item in sched.scheduled:
            seq = item.seq
            real_end = item.end - item.num_draft_tokens
            first_row = len(ids)
            ids.extend(seq.token_ids[item.start:real_end])
            ids.extend(seq.draft_token_ids)
            query_lens.append(item.num_new_tokens)
            seq_lens.append(item.end)
            tables.append(seq.block_table)
            plan.add(item, first_row)
        return self._tensors(ids, query_lens, seq_lens, tables, plan), plan

    def _tensors(self, ids: list[int], query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                 plan: "_LogitsPlan") -> ModelInput:
        dev, bs = self.device, self.block_size
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        q_lens = torch.tensor(query_lens)
        s_lens = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=starts[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        ctx = s_lens - q_lens
        positions = ctx[seq_of_token] + torch.arange(len(ids)) - starts[:-1][seq_of_token]
        slots = block_tables[seq_of_token, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), query_start_loc=starts.to(dev), seq_lens=s_lens.to(dev),
            context_lens=ctx.to(torch.int32).to(dev), block_tables=block_tables.to(dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens, query_start_loc_cpu=starts.tolist(), context_lens_cpu=ctx.tolist())
        return ModelInput(torch.tensor(ids, device=dev), positions.to(dev), meta,
                          torch.tensor(plan.rows, dtype=torch.long, device=dev))

    # ---- sampling ------------------------------------------------------------------------
    def sample(self, plan: "_LogitsPlan", logits: torch.Tensor) -> ModelOutput:
        """Prompt logprobs, sampling and draft verification for every planned sequence.

        A sequence whose own part of this raises (hostile sampling values, a bug that one
        request's options trigger) is reported in ``ModelOutput.failed`` and gets no result;
        every other sequence gets exactly the result it would have had without it."""
        out = ModelOutput()
        batch = _SampleBatch()
        spec: list[_Entry] = []
        for entry in plan.entries:
            try:
                self._plan_entry(entry, logits, out, batch, spec)
            except Exception as exc:
                self._fail(out, entry.item.seq, exc)
        if batch.rows:
            self._sample_batch(batch, logits, out)
        if spec:
            self._verify_drafts(spec, logits, out)
        return out

    def _plan_entry(self, entry: "_Entry", logits: torch.Tensor, out: ModelOutput, batch: "_SampleBatch",
                    spec: list["_Entry"]) -> None:
        """Prompt logprobs now; the entry's sampling rows into ``batch`` (or ``spec``)."""
        seq = entry.item.seq
        if entry.prompt_rows:
            k = seq.params.prompt_logprobs or 0
            lps = prompt_logprobs(logits[entry.prompt_rows], entry.prompt_next_tokens, k)
            result = out.results.setdefault(seq.seq_id, SeqStepResult([]))
            result.prompt_logprobs = ([None] if not seq.request.prompt_logprobs else []) + lps
        if entry.sample_row is None:
            return
        if entry.item.num_draft_tokens:
            spec.append(entry)
            return
        indices = [seq.sample_index] if entry.num_samples == 1 else list(range(entry.num_samples))
        batch.add(seq, entry.sample_row, [self._sample_row(seq, i) for i in indices])

    def _sample_batch(self, batch: "_SampleBatch", logits: torch.Tensor, out: ModelOutput) -> None:
        def call(idx: list[int]) -> SamplerOutput:
            return self.sampler(logits[[batch.row_of[i] for i in idx]], [batch.rows[i] for i in idx])

        generators = [r.generator for r in batch.rows] + [self.sampler.generator]
        sampled = run_rows(call, len(batch.rows), generators, "sampling")
        for i, exc in sampled.failed.items():
            self._fail(out, batch.owners[i], exc)
        for idx, chunk in sampled.chunks:
            for j, i in enumerate(idx):
                seq, row = batch.owners[i], batch.rows[i]
                if seq.seq_id in out.failed:
                    continue  # another of its samples failed: the request ends
                result = out.results.setdefault(seq.seq_id, SeqStepResult([]))
                result.token_ids.append(chunk.token_ids[j])
                if chunk.token_logprobs is not None and row.params.logprobs is not None:
                    result.token_logprobs = (result.token_logprobs or []) + [chunk.token_logprobs[j]]
                    result.logprobs = (result.logprobs or []) + [chunk.logprobs[j]]

    def _verify_drafts(self, entries: list["_Entry"], logits: torch.Tensor, out: ModelOutput) -> None:
        """Speculating sequences: accept a prefix of their drafts, then one target token."""
        from pagoda.spec_decode.rejection import DraftRow, verify

        kept, drafts, row_sets = [], [], []
        for entry in entries:
            seq = entry.item.seq
            try:
                drafts.append(DraftRow(self._sample_row(seq, seq.sample_index), seq.draft_token_ids, seq.draft_probs))
            except Exception as exc:
                self._fail(out, seq, exc)
                continue
            kept.append(entry)
            row_sets.append(list(range(entry.sample_row, entry.sample_row + entry.item.num_draft_tokens + 1)))
        default = self.sampler.generator if logits.device.type == "cpu" else None

        def call(idx: list[int]) -> list[Verdict]:
            return verify(logits[[r for i in idx for r in row_sets[i]]], [drafts[i] for i in idx], default)

        verdicts = run_rows(call, len(drafts), [d.row.generator for d in drafts] + [default], "draft verification")
        for i, exc in verdicts.failed.items():
            self._fail(out, kept[i].item.seq, exc)
        for idx, chunk in verdicts.chunks:
            for i, verdict in zip(idx, chunk):
                try:
                    self._emit_verdict(kept[i].item.seq, drafts[i], verdict, logits[row_sets[i]], out)
                except Exception as exc:
                    self._fail(out, kept[i].item.seq, exc)

    def _emit_verdict(self, seq: Sequence, draft: DraftRow, verdict: Verdict, rows: torch.Tensor,
                      out: ModelOutput) -> None:
        """The accepted drafts and the target's token, with their logprobs when asked."""
        result = SeqStepResult(verdict.token_ids, num_draft_accepted=verdict.num_accepted)
        if draft.row.params.logprobs is not None:
            emitted = rows[:len(verdict.token_ids)].float().log_softmax(-1)
            lp = self.sampler.gather_logprobs(emitted, verdict.token_ids, [draft.row] * len(verdict.token_ids))
            result.token_logprobs, result.logprobs = lp.token_logprobs, lp.logprobs
        out.results[seq.seq_id] = result

    @staticmethod
    def _fail(out: ModelOutput, seq: Sequence, exc: Exception) -> None:
        """End ``seq``'s request for this step's failure; the traceback goes to the log."""
        logger.error("request %s failed while sampling; ending it alone", seq.request_id, exc_info=exc)
        out.failed[seq.seq_id] = describe(exc)
        out.results.pop(seq.seq_id, None)

    @staticmethod
    def _sample_row(seq: Sequence, index: int) -> SampleRow:
        return SampleRow(seq.params, seq.request.generators[index], seq.request.prompt_token_ids,
                         seq.output_token_ids, seq.request.eos_token_ids + tuple(seq.params.stop_token_ids))


class _SampleBatch:
    """The ordinary (non-speculating) sampling rows of a step: a sequence with ``n > 1`` samples
    at its prompt's end owns ``n`` consecutive rows."""

    def __init__(self) -> None:
        self.rows: list[SampleRow] = []
        self.row_of: list[int] = []  # the logits row of each
        self.owners: list[Sequence] = []

    def add(self, seq: Sequence, logits_row: int, rows: list[SampleRow]) -> None:
        self.rows.extend(rows)
        self.row_of.extend([logits_row] * len(rows))
        self.owners.extend([seq] * len(rows))


@dataclass
class _Entry:
    item: ScheduledSeq
    sample_row: int | None
    num_samples: int
    prompt_rows: list[int]
    prompt_next_tokens: list[int]


class _LogitsPlan:
    """Which hidden rows need logits: each sampling sequence's last row, and for requests
    asking for prompt logprobs, every prompt position of the chunk."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.entries: list[_Entry] = []

    def add(self, item: ScheduledSeq, first_row: int) -> None:
        seq = item.seq
        prompt_rows, next_tokens = [], []
        # Positions already reported (before a preemption) are not reported twice.
        done = max(len(seq.request.prompt_logprobs) - 1, 0)
        if seq.params.prompt_logprobs is not None and max(item.start, done) < seq.num_prompt_tokens - 1:
            last = min(item.end, seq.num_prompt_tokens - 1)
            for pos in range(max(item.start, done), last):
                prompt_rows.append(len(self.rows))
                self.rows.append(first_row + pos - item.start)
                next_tokens.append(seq.token_ids[pos + 1])
        sample_row = None
        if item.samples:
            sample_row = len(self.rows)
            # With drafts: the last real token's row, then one row per draft (consecutive).
            last_real = first_row + item.num_new_tokens - item.num_draft_tokens - 1
            self.rows.extend(range(last_real, last_real + item.num_draft_tokens + 1))
        self.entries.append(_Entry(item, sample_row, seq.num_samples if item.samples else 1,
                                   prompt_rows, next_tokens))
