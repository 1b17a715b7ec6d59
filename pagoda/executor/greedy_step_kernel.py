"""The work between two replays of a greedy round (``DecodeGraphs.greedy_round``) in two Triton
launches, where the torch way launches about a dozen tiny kernels (``nan_to_num``, ``argmax``,
a copy, three adds, the slot arithmetic), each a couple of microseconds of the device's critical
path when a batch-1 step of a small model is under a millisecond.

``_chunk_argmax_kernel``, program (row, chunk): the largest logit of ``CHUNK`` columns and the
first column holding it, the logits read as ``sampler.finite_logits`` leaves them (NaN never
wins, +inf counts as the dtype's largest finite value). ``_advance_kernel``, a program a row:
the row's token (the largest of its chunks' values, the first column on a tie: torch's argmax),
written to the round's token buffer and, when the round goes on, as the row's next input, with
its position, sequence and context lengths one more and its slot from the block table (the
scheduler allocated the round's blocks before it started; a column past the table gives the
padding slot rather than a read out of bounds).
"""
from __future__ import annotations

import torch

from pagoda.executor.graph_inputs_kernel import step_jit_options
from pagoda.kernels.triton_import import HAS_TRITON, tl, triton

CHUNK = 2048

if HAS_TRITON:

    @triton.jit
    def _chunk_argmax_kernel(logits_ptr, val_ptr, idx_ptr, vocab, stride_l, pos_max, num_chunks,
                             CHUNK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = cols < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=inside, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)  # NaN: never chosen
        x = tl.where(x == float("inf"), pos_max, x)  # +inf: the dtype's largest finite value
        best = tl.max(x, axis=0)
        first = tl.min(tl.where((x == best) & inside, cols, vocab), axis=0)
        tl.store(val_ptr + row * num_chunks + chunk, best)
        tl.store(idx_ptr + row * num_chunks + chunk, first)

    # Each step of a round passes another row of the token buffer and says whether to move on:
    # neither may pick a specialization of its own (a JIT compile inside the round).
    @triton.jit(**step_jit_options(("advance",), ("tokens_ptr",)))
    def _advance_kernel(val_ptr, idx_ptr, tokens_ptr, ids_ptr, pos_ptr, slot_ptr, lens_ptr, ctx_ptr, bt_ptr,
                        num_chunks, vocab, advance, stride_bt, max_blocks, block_size, pad_slot,
                        CHUNKS_PAD: tl.constexpr):
        row = tl.program_id(0)
        chunks = tl.arange(0, CHUNKS_PAD)
        real = chunks < num_chunks
        vals = tl.load(val_ptr + row * num_chunks + chunks, mask=real, other=float("-inf"))
        idxs = tl.load(idx_ptr + row * num_chunks + chunks, mask=real, other=vocab)
        best = tl.max(vals, axis=0)
        token = tl.min(tl.where((vals == best) & real, idxs, vocab), axis=0).to(tl.int64)
        tl.store(tokens_ptr + row, token)
        if advance != 0:
            tl.store(ids_ptr + row, token)
            pos = tl.load(pos_ptr + row) + 1
            tl.store(pos_ptr + row, pos)
            tl.store(lens_ptr + row, tl.load(lens_ptr + row) + 1)
            tl.store(ctx_ptr + row, tl.load(ctx_ptr + row) + 1)
            col = pos // block_size
            block = tl.load(bt_ptr + row.to(tl.int64) * stride_bt + col, mask=col < max_blocks, other=-1)
            tl.store(slot_ptr + row, tl.where(block >= 0, block.to(tl.int64) * block_size + pos % block_size,
                                              pad_slot))


def greedy_step(logits: torch.Tensor, tokens: torch.Tensor, buffers, block_size: int, advance: bool,
                pad_slot: int) -> None:
    """Each row's greedy token of ``logits`` ``[n, vocab]`` into ``tokens`` ``[n]`` (int64), and
    with ``advance`` rows ``[0, n)`` of ``buffers`` (``StaticDecodeInputs``) moved on by that
    token, as the module notes say. Nothing is read back to the host."""
    n, vocab = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1 or tokens.stride(0) != 1:
        raise ValueError("greedy_step: logits rows and tokens need a unit inner stride")
    num_chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty((n, num_chunks), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((n, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(n, num_chunks)](logits, vals, idxs, vocab, logits.stride(0),
                                          torch.finfo(logits.dtype).max, num_chunks, CHUNK=CHUNK, num_warps=4)
    tables = buffers.block_tables
    _advance_kernel[(n,)](vals, idxs, tokens, buffers.input_ids, buffers.positions, buffers.slot_mapping,
                          buffers.seq_lens, buffers.context_lens, tables, num_chunks, vocab, int(advance),
                          tables.stride(0), tables.shape[1], block_size, pad_slot,
                          CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1)
