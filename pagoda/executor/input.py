"""The tensors of one forward pass (``ModelInput``) and the one place they are built.

``prepare_model_input(SchedulerOutput)`` is what a step runs on: it also returns the
``LogitsPlan`` (which hidden rows need logits, and what each is for). ``build_model_input``
is the tensor arithmetic under it, for callers that lay out their own batch (the draft model,
the memory profile's dummy step). The tensor-parallel channel ships a ``ModelInput`` to the
workers and the CUDA-graph code copies one into its static buffers.

Building is vectorised with torch: positions and the slot mapping come from index arithmetic,
not a Python loop per token. Each block table row is one C-level copy of its ``BlockTable``'s
int32 mirror (``table_rows``), so it costs the same at any context length. Tensors reach the
device through ``transfer.to_device``, which never waits for the device: under async scheduling
the next step's inputs are built while this step runs.
"""
from __future__ import annotations

import array
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from pagoda.kvcache.block_table import BlockTable
from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.transfer import to_device

if TYPE_CHECKING:  # the scheduler's output is only read here
    from pagoda.step import ScheduledSeq, SchedulerOutput


@dataclass
class ModelInput:
    """The tensors of one forward pass (what tensor-parallel workers receive)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] (or [3, T]: see ``mm``)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need logits
    # LoRA: each token row's adapter slot (-1: the base model), on the host; None: no adapters.
    lora_slots: torch.Tensor | None = None
    # Every hidden row, in order, gets logits (``logits_indices`` is 0..T-1): no gather needed.
    logits_all_rows: bool = False
    # Vision-language models: the rows holding image placeholder tokens and the image features
    # that replace their embeddings (``multimodal.encoder_cache.MultimodalStep``); ``positions``
    # is then ``[3, T]`` (M-RoPE) where the step runs part of such a prompt. None: text only.
    mm: tuple[torch.Tensor, torch.Tensor] | None = None


def build_model_input(token_ids: list[int], query_lens: list[int], seq_lens: list[int],
                      block_tables: list[list[int]], logits_rows: list[int], device: torch.device,
                      block_size: int, seq_lora_slots: list[int] | None = None) -> ModelInput:
    """A flattened batch: sequence ``i`` runs ``query_lens[i]`` new tokens (consecutive in
    ``token_ids``) ending at position ``seq_lens[i]``, its K/V in the blocks of
    ``block_tables[i]``; ``logits_rows`` are the token rows whose hidden states get logits;
    ``seq_lora_slots[i]`` is its LoRA adapter slot (-1: none)."""
    dev, bs = device, block_size
    width = max(map(len, block_tables))
    if len(token_ids) == len(query_lens):  # all decodes: one token per sequence, no index arithmetic
        return _decode_input(token_ids, seq_lens, block_tables, width, logits_rows, dev, bs, seq_lora_slots)
    n = len(block_tables)
    tables = (torch.frombuffer(table_rows(array.array("i"), block_tables, width), dtype=torch.int32).view(n, width)
              if width else torch.zeros(n, 0, dtype=torch.int32))
    q_lens = torch.tensor(query_lens)
    s_lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=starts[1:])
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    ctx = s_lens - q_lens
    positions = ctx[seq_of_token] + torch.arange(len(token_ids)) - starts[:-1][seq_of_token]
    slots = tables[seq_of_token, positions // bs].long() * bs + positions % bs
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, dev), query_start_loc=to_device(starts, dev), seq_lens=to_device(s_lens, dev),
        context_lens=to_device(ctx.to(torch.int32), dev), block_tables=to_device(tables, dev),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens, query_start_loc_cpu=starts.tolist(), context_lens_cpu=ctx.tolist())
    lora_slots = None
    if seq_lora_slots is not None:
        lora_slots = torch.repeat_interleave(torch.tensor(seq_lora_slots, dtype=torch.int64), q_lens)
    return ModelInput(to_device(torch.tensor(token_ids, dtype=torch.long), dev), to_device(positions, dev), meta,
                      to_device(torch.tensor(logits_rows, dtype=torch.long), dev), lora_slots)


def _decode_input(token_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], width: int,
                  logits_rows: list[int], dev: torch.device, bs: int,
                  seq_lora_slots: list[int] | None) -> ModelInput:
    """``build_model_input`` for a batch of decodes, in plain Python: a decode step of a few
    sequences is short enough that a dozen small tensor ops would be a visible share of it."""
    n = len(token_ids)
    ctx = [s - 1 for s in seq_lens]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, ctx)]
    starts = list(range(n + 1))
    # Two tensors, each cut into views by one split: a step runs right after the previous one
    # streamed the weights through every cache level, so each torch call here costs ten
    # microseconds or more (cold code and data), whatever little work it does.
    longs = _host_tensor(slots + token_ids + ctx + logits_rows, torch.int64)
    ints = torch.frombuffer(table_rows(array.array("i", seq_lens + ctx + starts), block_tables, width),
                            dtype=torch.int32)
    lora_slots = None if seq_lora_slots is None else _host_tensor(seq_lora_slots, torch.int64)
    return decode_input_from(longs, ints, seq_lens, ctx, starts, width, logits_rows, dev, lora_slots)


def decode_input_from(longs: torch.Tensor, ints: torch.Tensor, seq_lens: list[int], ctx: list[int],
                      starts: list[int], width: int, logits_rows: list[int], dev: torch.device,
                      lora_slots: torch.Tensor | None = None) -> ModelInput:
    """A decode step's ``ModelInput`` from its two host tensors, each moved once and cut into
    views: ``longs`` (int64) = slots, token ids, positions (``ctx``), ``logits_rows``; ``ints``
    (int32) = ``seq_lens``, ``ctx``, query ``starts``, the block tables' ``n * width`` entries."""
    n = len(seq_lens)
    longs, ints = to_device(longs, dev), to_device(ints, dev)
    slot_mapping, ids, positions, logits_indices = torch.split_with_sizes(longs, [n, n, n, len(logits_rows)])
    lens, context_lens, query_start_loc, tables = torch.split_with_sizes(ints, [n, n, n + 1, n * width])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=lens, context_lens=context_lens,
        block_tables=tables.view(n, width), max_query_len=1, max_seq_len=max(seq_lens), query_lens_cpu=[1] * n,
        seq_lens_cpu=seq_lens, query_start_loc_cpu=starts, context_lens_cpu=ctx)
    return ModelInput(ids, positions, meta, logits_indices, lora_slots, logits_all_rows=logits_rows == starts[:-1])


def inputs_to_device(inputs: ModelInput, device: torch.device) -> ModelInput:
    """``inputs`` built on the host, on ``device`` (the same object where that is the host). The
    copies do not wait for the device (``transfer.to_device``): the step before is still running.
    Tensors that are views of one host buffer (a decode step's two) go over in one copy each."""
    if inputs.input_ids.device == device:
        return inputs
    m = inputs.meta
    ids, pos, slots, starts, lens, ctx, tables, logits = moved_together(
        [inputs.input_ids, inputs.positions, m.slot_mapping, m.query_start_loc, m.seq_lens, m.context_lens,
         m.block_tables, inputs.logits_indices], lambda t: to_device(t, device))
    meta = dataclasses.replace(m, slot_mapping=slots, query_start_loc=starts, seq_lens=lens, context_lens=ctx,
                               block_tables=tables)
    return dataclasses.replace(inputs, input_ids=ids, positions=pos, meta=meta, logits_indices=logits)


def moved_together(tensors: list[torch.Tensor], copy: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """``copy`` of each tensor, where tensors viewing one buffer (of their dtype) share one
    ``copy`` of that buffer and come back as the same views of it."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        base = t._base
        if base is None or base.dtype != t.dtype or not base.is_contiguous():
            out.append(copy(t))
            continue
        if id(base) not in copies:
            copies[id(base)] = copy(base)
        moved = copies[id(base)]
        if not moved.is_contiguous():  # (a copy that changed the layout: each view on its own)
            out.append(copy(t))
            continue
        out.append(moved.as_strided(t.shape, t.stride(),
                                    moved.storage_offset() + t.storage_offset() - base.storage_offset()))
    return out


def table_rows(out: array.array, block_tables: list[list[int]], width: int) -> array.array:
    """``out`` (an ``array('i')``) extended by each block table padded with 0 to ``width``
    entries. A ``BlockTable`` row is one C-level copy of its int32 mirror, whatever its length
    (flattening the lists cost ~40 ns per block per step); a plain list is converted in C."""
    for table in block_tables:
        out += table.ints if type(table) is BlockTable else array.array("i", table)
        pad = width - len(table)
        if pad:
            out.frombytes(bytes(4 * pad))
    return out


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def _host_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``values`` (non-empty) made through ``array.array``: one C conversion of
    the list, where ``torch.tensor(list)`` parses it element by element (~4x the time, measured
    at 150 ints: 3.5 against 15.8 us warm, 25 against 136 us with cold caches)."""
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


# The decode rows' shortcut in ``prepare_model_input``; tests turn it off to check it builds
# what the general path builds.
FAST_PATHS = True


def prepare_model_input(sched: "SchedulerOutput", device: torch.device, block_size: int,
                        seq_lora_slots: list[int] | None = None) -> tuple[ModelInput, "LogitsPlan"]:
    """The forward pass of a scheduled step: each sequence's tokens ``[start, end)``, a
    speculating sequence's draft tokens after its last real token; ``seq_lora_slots`` gives
    each scheduled sequence's LoRA slot (None: no adapter in this step)."""
    ids: list[int] = []
    query_lens, seq_lens, tables, state_slots = [], [], [], []
    plan = LogitsPlan()
    rows, entries = plan.rows, plan.entries
    for item in sched.scheduled:
        seq = item.seq
        start, params, token_ids = item.start, seq.params, seq.token_ids
        if (item.num_new_tokens == 1 and item.draft is None and start + 1 >= len(token_ids)
                and params.pooling is None and FAST_PATHS):
            # A decode that samples (most of a step): its one token and its one logits row,
            # what the general path below and ``LogitsPlan.add`` make of it (its one position,
            # the sequence's last, is past any prompt logprobs: none to add).
            entries.append(PlanEntry(item, len(rows), seq.num_samples, [], []))
            rows.append(len(ids))
            ids.append(token_ids[start])
            query_lens.append(1)
            seq_lens.append(start + 1)
        else:
            first_row = len(ids)
            ids.extend(token_ids[start:item.end - item.num_draft_tokens])
            if item.draft is not None:
                ids.extend(item.draft.token_ids)
            query_lens.append(item.num_new_tokens)
            seq_lens.append(item.end)
            plan.add(item, first_row)
        tables.append(seq.block_table)
        state_slots.append(getattr(seq, "state_slot", None))
    inputs = build_model_input(ids, query_lens, seq_lens, tables, plan.rows, device, block_size, seq_lora_slots)
    if state_slots and state_slots[0] is not None:  # a hybrid model's sequences each hold a slot
        inputs.meta.state_slots = state_slots
    return inputs, plan


@dataclass
class PlanEntry:
    """One scheduled sequence's logits rows (indices into the step's logits)."""

    item: "ScheduledSeq"
    sample_row: int | None  # first sampling row (a speculating sequence has k + 1 in a row)
    num_samples: int  # rows drawn from ``sample_row``: n when a prompt forks into its samples
    prompt_rows: list[int]
    prompt_next_tokens: list[int]


@dataclass
class LogitsPlan:
    """Which hidden rows need logits: each sampling sequence's last row (and its draft rows),
    and for requests asking for prompt logprobs, every prompt position of the chunk."""

    rows: list[int] = field(default_factory=list)
    entries: list[PlanEntry] = field(default_factory=list)
    # Embedding requests (``SamplingParams.pooling``): each chunk and its first hidden row; they
    # need hidden states, not logits.
    pooled: list[tuple["ScheduledSeq", int]] = field(default_factory=list)

    def add(self, item: "ScheduledSeq", first_row: int) -> None:
        seq = item.seq
        params = seq.params
        if params.pooling is not None:
            self.pooled.append((item, first_row))
            return
        prompt_rows: list[int] = []
        next_tokens: list[int] = []
        if params.prompt_logprobs is not None:
            self._add_prompt_rows(item, first_row, prompt_rows, next_tokens)
        sample_row = None
        samples = item.samples
        if samples:
            sample_row = len(self.rows)
            drafts = item.num_draft_tokens
            if drafts:  # the last real token's row, then one row per draft (consecutive)
                last_real = first_row + item.num_new_tokens - drafts - 1
                self.rows.extend(range(last_real, last_real + drafts + 1))
            else:
                self.rows.append(first_row + item.num_new_tokens - 1)
        self.entries.append(PlanEntry(item, sample_row, seq.num_samples if samples else 1, prompt_rows, next_tokens))

    def _add_prompt_rows(self, item: "ScheduledSeq", first_row: int, prompt_rows: list[int],
                         next_tokens: list[int]) -> None:
        """The rows of the chunk's prompt positions whose logprobs are asked for (each with the
        prompt token that follows it), appended to ``rows``, ``prompt_rows`` and ``next_tokens``."""
        seq = item.seq
        # Positions already reported (before a preemption) are not reported twice.
        done = max(len(seq.request.prompt_logprobs) - 1, 0)
        if max(item.start, done) < seq.num_prompt_tokens - 1:
            last = min(item.end, seq.num_prompt_tokens - 1)
            for pos in range(max(item.start, done), last):
                prompt_rows.append(len(self.rows))
                self.rows.append(first_row + pos - item.start)
                next_tokens.append(seq.token_ids[pos + 1])
