"""Triton decode kernel for multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Each cache row is ``[c_kv | k_pe]``: ``value_dim`` (``kv_lora_rank``, 512) latent values and
``rope_dim`` (64) rotary key values, one "head" shared by every query head (``mla.py``). The
generic decode kernel would treat that row as a 576-wide head padded to 1024, read it twice
(as K and as V) and keep a ``[heads, 1024]`` accumulator; this kernel reads each cache tile once
and uses it twice: scores are ``q_lat . c_kv + q_pe . k_pe`` and the values are the same
``c_kv`` tile, so the accumulator is ``[BLOCK_H, value_dim]`` and nothing is padded past the
two parts' own powers of two.

A program owns one sequence, ``BLOCK_H`` query heads and one split of the context
(flash-decoding, merged by the generic ``_merge_splits_kernel``). An int8/fp8 cache has one
scale per token (the row is the one head): it multiplies the scores and the probabilities, as
in the generic kernels. Runs under Triton's interpreter on CPU (the tests) like the others.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.layers.attention import kv_quant
from pagoda.layers.attention import triton_kernels as tk
from pagoda.layers.attention.triton_kernels import _fold_scores, _kv_offsets, _split_tiles, _store_decode_rows


@triton.jit
def _mla_decode_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_lse_ptr, part_acc_ptr,
                       scale_ptr, qk_scale, num_splits, num_heads,
                       stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_bt,
                       stride_sb, stride_ss,
                       LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
                       PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       PRECISION: tl.constexpr, DOT_F32: tl.constexpr, QUANT: tl.constexpr):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_lo, tile_hi = _split_tiles(0, seq_len, split, num_splits, BLOCK_N)

    offs_l = tl.arange(0, LORA_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < num_heads
    l_mask = offs_l < LORA
    r_mask = offs_r < ROPE
    q_row = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + LORA + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        n_mask = pos < seq_len
        offs = _kv_offsets(bt_row, pos, n_mask, 0, stride_cb, stride_cs, 0, PAGE)
        c = tl.load(cache_ptr + offs[:, None] + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        pe = tl.load(cache_ptr + offs[:, None] + LORA + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                     other=0.0)
        c = c.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(pe.to(q_pe.dtype)), s, input_precision=PRECISION) * qk_scale
        if QUANT:
            soffs = _kv_offsets(bt_row, pos, n_mask, 0, stride_sb, stride_ss, 0, PAGE)
            row_scale = tl.load(scale_ptr + soffs, mask=n_mask, other=0.0).to(tl.float32)
            s = s * row_scale[None, :]
        else:
            row_scale = tl.full([BLOCK_N], 1.0, tl.float32)  # unread without QUANT
        # The values are the same tile's first LORA columns: c itself.
        m_i, l_i, acc = _fold_scores(s, n_mask[None, :], c, m_i, l_i, acc, row_scale, True, PRECISION, QUANT)

    _store_decode_rows(acc, m_i, l_i, seq, heads, h_mask, offs_l, l_mask, split, num_splits, num_heads, out_ptr,
                       stride_ob, stride_oh, part_lse_ptr, part_acc_ptr, LORA, SPLIT)


def _default_block_h(num_heads: int) -> int:
    return 16 if tk._interpreting() else min(32, max(16, triton.next_power_of_2(num_heads)))


def mla_decode_launch_options(num_heads: int, value_dim: int, rope_dim: int, page: int, dtype: torch.dtype,
                              split: bool, block_h: int | None = None, block_n: int | None = None) -> dict:
    """Constexprs and launch settings of ``_mla_decode_kernel``; ``block_h``/``block_n``
    override the head and token tiles (tests, ``pagoda bench gpu attention``'s MLA sweep).

    The default holds a ``[32, 512]`` fp32 accumulator over 8 warps (64 registers a thread)
    and reads 32-token tiles of 1,152 bytes a row in bf16; 16 heads is the least ``tl.dot``
    takes, so fewer heads are padded with masked rows.
    """
    lora_pad = triton.next_power_of_2(value_dim)
    block_h = _default_block_h(num_heads) if block_h is None else block_h
    if block_n is None:
        block_n = 16 if tk._interpreting() else 32
    return dict(LORA=value_dim, LORA_PAD=lora_pad, ROPE=rope_dim, ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
                PAGE=page, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=split,
                num_warps=4 if lora_pad * block_h <= 4096 else 8, num_stages=2, **tk._dot_options(dtype))


def mla_head_blocks(num_heads: int) -> int:
    """Programs a sequence's latent decode spreads over before any split: its head tiles at the
    default ``BLOCK_H`` (what split counts are planned from, eager or pinned for a graph)."""
    return triton.cdiv(num_heads, _default_block_h(num_heads))


def paged_mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, value_dim: int,
                               num_splits: int | None = None, max_seq_len: int | None = None,
                               out: torch.Tensor | None = None, cache_scale: torch.Tensor | None = None,
                               block_h: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Latent attention of one query token per sequence: ``q`` ``[B, H, value_dim + rope_dim]``
    (``[q_nope W_UK | q_pe]``) over ``cache`` ``[num_blocks, page, 1, value_dim + rope_dim]``;
    returns ``[B, H, value_dim]``, the probability-weighted sum of the rows' first ``value_dim``
    columns. ``cache_scale`` ``[num_blocks, page, 1]``: the per-token scales of an int8/fp8
    cache. ``num_splits`` None plans from ``max_seq_len`` (the block table's width when
    omitted); any count is correct, so a CUDA graph captured with one stays valid.
    """
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.stride(-1) != 1:
        raise ValueError(f"a latent cache is [blocks, page, 1, dim] with unit stride on dim, got {tuple(cache.shape)}")
    if (cache_scale is not None) != kv_quant.is_quantized(cache.dtype):
        raise ValueError("an int8/fp8 latent cache needs cache_scale, a float cache has none")
    q = tk._unit_inner(q)
    num_seqs, num_heads, dim = q.shape
    rope_dim = dim - value_dim
    if dim != cache.shape[3] or rope_dim < 0:
        raise ValueError(f"query width {dim} and cache row {cache.shape[3]} (value_dim {value_dim}) disagree")
    if out is None:
        out = torch.empty((num_seqs, num_heads, value_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    opts = mla_decode_launch_options(num_heads, value_dim, rope_dim, cache.shape[1], q.dtype, False, block_h, block_n)
    head_blocks = triton.cdiv(num_heads, opts["BLOCK_H"])
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * cache.shape[1]
        num_splits = tk.choose_num_splits(num_seqs, head_blocks, bound, tk._device_sm_count(q.device))
    split = num_splits > 1
    opts["SPLIT"] = split
    part_lse, part_acc = (tk._split_workspace(num_seqs, num_heads, num_splits, value_dim, q.device)
                          if split else (out, out))  # unused without splits
    scales = cache_scale if cache_scale is not None else cache
    scale_strides = (cache_scale.stride(0), cache_scale.stride(1)) if cache_scale is not None else (0, 0)
    _mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        q, cache, block_tables, seq_lens, out, part_lse, part_acc, scales, scale * tk._LOG2E, num_splits, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), *scale_strides, QUANT=cache_scale is not None, **opts)
    if split:
        tk.merge_splits(part_lse, part_acc, out, None, num_splits)
    return out
