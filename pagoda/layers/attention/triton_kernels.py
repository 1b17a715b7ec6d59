"""Triton paged-attention kernels: pagoda's GPU fast path.

Layout and semantics follow ``backend.py``: caches are ``[num_blocks, block_size, Hkv, D]``,
``block_tables[b, i]`` is the physical block holding sequence ``b``'s tokens
``i*block_size .. (i+1)*block_size-1``.

Kernels:
  * ``write_kv``: scatters the step's new K/V into the cache (slot -1 = padding, skipped).
  * ``paged_decode_attention``: one query token per sequence. A program owns one
    (sequence, KV head) pair and all query heads of that group, so each K/V tile is read from
    HBM once per group. Long contexts are split over several programs (flash-decoding) whose
    partial results a second kernel merges.
  * ``paged_prefill_attention``: any number of new tokens per sequence (prefill, chunked
    prefill, prefix-cache extends, mixed batches), all K/V read through the block table.
    Query rows are (token, head-of-group) pairs, so GQA groups again share K/V tiles.

All kernels gather K/V token by token through the block table, so any power-of-two block
size works, block_size 1 included, and the tile width is independent of it. Head dims that
are not powers of two (80, 96) are padded to the next one with masks. Scores and
accumulators are fp32 whatever the input dtype; softmax runs in base 2 with log2(e) folded
into the scale.

Quantized caches (int8 / fp8 values with one bf16 scale per token and K/V head beside them,
``kv_quant.py``): ``write_kv`` quantizes in the kernel, and the attention kernels load the
stored values tile by tile, convert them exactly to the query dtype and fold the scales into
the scores (K) and the probabilities (V), so no dequantized copy of the context is ever made.

Attention logit soft-capping (``softcap``, Gemma 2): the kernels take it as ``SOFTCAP`` and cap
each score tile in ``_online_softmax_step`` (``softcap * tanh(s / softcap)``, tanh from the
sigmoid), after the K scales and before the mask.

Attention sinks (``sinks``, gpt-oss: a logit per head in the softmax denominator) join each
row's running (max, sum) once, after its keys (``_fold_sinks``; split decode: in the merge of
the splits). Chunked local attention (``attention_chunk_size``, Llama 4) bounds each row's first
key at the start of its chunk, as a sliding window bounds it at ``window`` positions back.

On a host without CUDA these run under Triton's interpreter (``TRITON_INTERPRET=1``, set
before ``triton`` is imported); that is how the CPU tests exercise them.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagoda.layers import pdl
from pagoda.layers.attention import kv_quant
from pagoda.layers.attention.backend import AttentionMetadata

_LOG2E = 1.4426950408889634

# Flash-decoding: a split should cover at least this many tokens (one key tile), otherwise
# writing and re-reading its fp32 partial result costs more than the parallelism gains. On an
# H200 one sequence of 8 KV heads at 384 tokens ran 2x faster in 16 splits than in 1
# (docs/benchmarks.md, decode-splits).
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64
# Aim for about this many programs per SM: one wave leaves SMs idle while the slowest
# program finishes; two waves balance uneven sequence lengths.
_PROGRAMS_PER_SM = 2
# Used when planning without a CUDA device (interpreter); an H200 has 132 SMs.
_DEFAULT_SM_COUNT = 132


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def _dot_options(dtype: torch.dtype) -> dict:
    """Constexprs controlling ``tl.dot`` for the query dtype."""
    return {
        # fp32 is only used for tests and debugging: ask for full precision rather than TF32.
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # The interpreter multiplies bf16 operands as raw integers; upcast them there.
        "DOT_F32": _interpreting() and dtype == torch.bfloat16,
    }


# --------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _kv_offsets(bt_row_ptr, pos, n_mask, kv_head, stride_b, stride_s, stride_h,
                PAGE: tl.constexpr):
    """Element offsets of token positions ``pos`` (head ``kv_head``) in a paged cache."""
    block = tl.load(bt_row_ptr + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    return block * stride_b + (pos % PAGE) * stride_s + kv_head * stride_h


@triton.jit
def _online_softmax_step(q, k, v, s_mask, m_i, l_i, acc, qk_scale, k_scale, v_scale, softcap_l2,
                         MASKED: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    """Fold one K/V tile into the running (max, sum, acc) of every query row (base 2).

    QUANT: ``k``/``v`` hold a quantized cache's stored values (exact in the query dtype) and
    ``k_scale``/``v_scale`` ``[BLOCK_N]`` their per-token scales: ``q . (k_t * ks_t)`` is
    ``(q . k_t) * ks_t`` and ``sum_t p_t (v_t * vs_t)`` is ``sum_t (p_t * vs_t) v_t``."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if QUANT:
        s = s * k_scale[None, :]
    if SOFTCAP:
        # Scores are in base 2 (log2(e) folded into qk_scale), and so is ``softcap_l2``
        # (softcap * log2(e)): cap * tanh(x / cap) is the same in either base.
        s = (2.0 * tl.sigmoid(2.0 * s / softcap_l2) - 1.0) * softcap_l2
    return _fold_scores(s, s_mask, v, m_i, l_i, acc, v_scale, MASKED, PRECISION, QUANT)


@triton.jit
def _fold_scores(s, s_mask, v, m_i, l_i, acc, v_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                 QUANT: tl.constexpr):
    """The online-softmax update for one tile's base-2 scores ``s`` (scaled, capped) and values
    ``v`` (``v_scale``: a quantized cache's per-token scales, folded into the probabilities)."""
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row may have seen no key yet (a sliding window starts past this tile): keep its
        # max finite so exp2(-inf - -inf) never makes a NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        pv = p * v_scale[None, :]
    else:
        pv = p
    acc = tl.dot(pv.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _fold_sinks(sinks_ptr, heads, h_mask, m_i, l_i, acc):
    """Each row's head sink (natural log) as one more logit in its softmax denominator."""
    sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _load_scales(ks_ptr, vs_ptr, bt_row, pos, n_mask, kv_head, stride_sb, stride_ss, stride_sh,
                 PAGE: tl.constexpr, QUANT: tl.constexpr):
    """The per-token K and V scales of positions ``pos`` (fp32; 0 where masked), or 1.0
    placeholders for a float cache (unused there)."""
    if QUANT:
        offs = _kv_offsets(bt_row, pos, n_mask, kv_head, stride_sb, stride_ss, stride_sh, PAGE)
        ks = tl.load(ks_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
        vs = tl.load(vs_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
    else:
        ks = tl.full(pos.shape, 1.0, tl.float32)
        vs = ks
    return ks, vs


# --------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows(x, mask, QMAX: tl.constexpr, IS_INT: tl.constexpr, MANT: tl.constexpr,
                   MIN_EXP: tl.constexpr):
    """Rows of ``x`` -> (values to store, bf16 scales): ``kv_quant.quantize`` in the kernel.

    The values come back already on the storage grid (integers; for fp8 the nearest value
    with MANT mantissa bits, subnormals below 2^MIN_EXP), so the final conversion is exact
    and no backend's float-to-fp8 rounding (Triton's interpreter mis-rounds values that
    carry into the next binade) decides what is stored."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    exact = tl.maximum(tl.max(tl.abs(x), 1), 1e-30) / QMAX
    rounded = exact.to(tl.bfloat16).to(tl.float32)
    # Round the scale up, never down (|x| / scale must not pass QMAX): one bf16 ulp is 2^16 in
    # the fp32 bit pattern, which orders like an integer for positive values.
    up = (rounded.to(tl.int32, bitcast=True) + 65536).to(tl.float32, bitcast=True)
    scale = tl.where(rounded < exact, up, rounded).to(tl.bfloat16)
    y = x / scale.to(tl.float32)[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT:
        y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))  # conversion truncates
    else:
        a = tl.abs(y)
        exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exp = tl.maximum(exp, MIN_EXP)
        ulp = ((exp - MANT + 127) << 23).to(tl.float32, bitcast=True)
        a = tl.floor(a / ulp + 0.5) * ulp
        y = tl.where(y < 0, -a, a)
    return y, scale


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks_ptr, vs_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, num_kv_heads,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                     PAGE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                     IS_INT: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, PDL: tl.constexpr = False):
    pdl.pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    # A negative slot marks a padding token: everything is masked off, nothing is written.
    # (Broadcast the slot to a vector first: the interpreter rejects scalar-bool masks.)
    keep = (tl.zeros([BLOCK_H], tl.int64) + slot >= 0) & (heads < num_kv_heads)
    mask = keep[:, None] & (offs_d[None, :] < HEAD_DIM)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    dst = dst + heads[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANT:
        k, k_scale = _quantize_rows(k, mask, QMAX, IS_INT, MANT, MIN_EXP)
        v, v_scale = _quantize_rows(v, mask, QMAX, IS_INT, MANT, MIN_EXP)
        scale_dst = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + heads * stride_sh
        tl.store(ks_ptr + scale_dst, k_scale, mask=keep)
        tl.store(vs_ptr + scale_dst, v_scale, mask=keep)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    # The kernels address K and V with one set of strides and assume unit stride on D.
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides and be contiguous along D")
    if (k_scale is not None) != kv_quant.is_quantized(k_cache.dtype) or (k_scale is None) != (v_scale is None):
        raise ValueError("an int8/fp8 cache needs k_scale and v_scale, a float cache has none")
    if k_scale is not None and (k_scale.stride() != v_scale.stride() or k_scale.shape != k_cache.shape[:3]):
        raise ValueError("k_scale and v_scale must be [num_blocks, block_size, num_kv_heads] with equal strides")


def _scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple:
    """(k_scale, v_scale, their three strides): the caches stand in when there are none (the
    kernels then never touch them)."""
    if k_scale is None:
        return (k_cache, k_cache, 0, 0, 0)
    return (k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), k_scale.stride(2))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter k, v ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (-1 = skip); into an
    int8/fp8 cache quantized, with each token-head's scale into ``k_scale``/``v_scale``."""
    _check_caches(k_cache, v_cache, k_scale, v_scale)
    k, v = _unit_inner(k), _unit_inner(v)
    num_tokens, num_kv_heads, head_dim = k.shape
    if slot_mapping.shape[0] != num_tokens or v.shape != k.shape:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and "
                         f"slot_mapping {tuple(slot_mapping.shape)} disagree on the token count")
    if num_tokens == 0:
        return
    d_pad = triton.next_power_of_2(head_dim)
    # A program moves up to ~4K elements: enough bytes in flight per program without
    # wasting lanes on masked-off heads.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // d_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, *_scale_args(k_cache, k_scale, v_scale)[:2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *_scale_args(k_cache, k_scale, v_scale)[2:], num_kv_heads,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_H=block_h, PAGE=k_cache.shape[1],
        **write_kv_quant_options(k_cache.dtype), num_warps=4, **pdl.launch_options(k.device))


def write_kv_quant_options(cache_dtype: torch.dtype) -> dict:
    """``_write_kv_kernel``'s quantization constexprs for a cache of ``cache_dtype``: QMAX, and
    for fp8 its mantissa bits and smallest normal exponent (also used by the compile test)."""
    fp8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
    mant, min_exp = fp8.get(cache_dtype, (0, 0))
    return dict(QUANT=kv_quant.is_quantized(cache_dtype), QMAX=kv_quant.QMAX.get(cache_dtype, 0.0),
                IS_INT=cache_dtype == torch.int8, MANT=mant, MIN_EXP=min_exp)


# --------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                   out_ptr, part_lse_ptr, part_acc_ptr, ks_ptr, vs_ptr, sinks_ptr,
                   qk_scale, num_splits, num_heads, window, chunk, softcap_l2,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_bt,
                   stride_sb, stride_ss, stride_sh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr, QUANT: tl.constexpr,
                   SOFTCAP: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr = False):
    pdl.pdl_enter(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # With a sliding window (window > 0) only positions lo..seq_len-1 are attended.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Chunked attention (chunk > 0): only the current token's chunk.
    lo = tl.where(chunk > 0, tl.maximum(lo, (seq_len - 1) // tl.maximum(chunk, 1) * chunk), lo)
    tile_lo, tile_hi = _split_tiles(lo, seq_len, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        n_mask = (pos < seq_len) & (pos >= lo)
        offs = _kv_offsets(bt_row, pos, n_mask, kv_head, stride_cb, stride_cs, stride_ch, PAGE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        ks, vs = _load_scales(ks_ptr, vs_ptr, bt_row, pos, n_mask, kv_head, stride_sb, stride_ss,
                              stride_sh, PAGE, QUANT)
        m_i, l_i, acc = _online_softmax_step(q, k.to(q.dtype), v.to(q.dtype), n_mask[None, :],
                                             m_i, l_i, acc, qk_scale, ks, vs, softcap_l2, True, PRECISION, QUANT,
                                             SOFTCAP)

    if SINKS and not SPLIT:  # split decode folds the sinks in when merging the splits
        l_i, acc = _fold_sinks(sinks_ptr, heads, g_mask, m_i, l_i, acc)
    _store_decode_rows(acc, m_i, l_i, seq, heads, g_mask, offs_d, d_mask, split, num_splits, num_heads, out_ptr,
                       stride_ob, stride_oh, part_lse_ptr, part_acc_ptr, HEAD_DIM, SPLIT)


@triton.jit
def _split_tiles(lo, seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    """The ``[tile_lo, tile_hi)`` tiles of ``BLOCK_N`` positions that split ``split`` of
    ``num_splits`` owns of positions ``lo .. seq_len - 1``. Splits own whole tiles; each sequence
    divides its own length, so a short sequence in a batch planned for long ones simply leaves
    its last splits empty."""
    first_tile = lo // BLOCK_N
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    return tile_lo, tl.minimum(tile_lo + tiles_per_split, n_tiles)


@triton.jit
def _store_decode_rows(acc, m_i, l_i, seq, heads, h_mask, offs_d, d_mask, split, num_splits, num_heads, out_ptr,
                       stride_ob, stride_oh, part_lse_ptr, part_acc_ptr, WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """A decode program's result rows (``heads`` of sequence ``seq``): normalised into ``out``, or
    with their log2-sum-exp into the split workspace for ``_merge_splits_kernel``. ``l_i`` is 0
    only for an empty split (or a zero-length padding sequence): zeros there instead of 0/0."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        row = (seq * num_heads + heads).to(tl.int64) * num_splits + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)
        tl.store(part_acc_ptr + row[:, None] * WIDTH + offs_d[None, :], out, mask=store_mask)
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out,
                 mask=store_mask)


@triton.jit
def _merge_splits_kernel(part_lse_ptr, part_acc_ptr, out_ptr, sinks_ptr, num_splits,
                         stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         SINKS: tl.constexpr, PDL: tl.constexpr = False):
    pdl.pdl_enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    rows = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty
    weight = tl.exp2(lse - lse_max)
    part = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    if SINKS:
        total += tl.exp2(sink - lse_max)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d, out, mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      sm_count: int = _DEFAULT_SM_COUNT) -> int:
    """How many programs share one (sequence, KV head) in decode.

    Without splitting a decode step runs ``num_seqs * num_kv_heads`` programs; a small batch
    with long contexts would leave most SMs idle while a few programs stream the whole
    context. Split until the grid roughly fills the GPU, but never below
    ``_MIN_TOKENS_PER_SPLIT`` tokens per split.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count, programs)
    by_length = max_seq_len // _MIN_TOKENS_PER_SPLIT
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def _split_workspace(num_seqs: int, num_heads: int, num_splits: int, head_dim: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial results of the splits: log2-sum-exp per row and the normalised output."""
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                      device=device)
    return lse, acc


def decode_launch_options(group: int, head_dim: int, page: int, dtype: torch.dtype,
                          split: bool, block_n: int | None = None, softcap: bool = False,
                          sinks: bool = False) -> dict:
    """Constexprs and launch settings of ``_decode_kernel`` (also used by the compile test).

    ``block_n`` overrides the tile width (tests, tuning).
    """
    d_pad = triton.next_power_of_2(head_dim)
    if block_n is None:
        # Decode is bandwidth-bound: 64 tokens per tile keeps enough bytes in flight; at D=256
        # halve it so the K and V tiles stay within registers. The interpreter just wants
        # small numpy tiles.
        block_n = 32 if _interpreting() or d_pad > 128 else 64
    return dict(
        # tl.dot needs M >= 16, so small groups are padded with masked-off rows.
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_N=block_n, SPLIT=split, SOFTCAP=softcap,
        SINKS=sinks, num_warps=4, num_stages=2, **_dot_options(dtype))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None,
                           block_n: int | None = None, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           attention_chunk_size: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (``k_scale`` and
    ``v_scale`` for an int8/fp8 cache; ``softcap`` caps the scores; ``sinks`` ``[H]`` float32
    per-head sink logits; ``attention_chunk_size``: only the token's own chunk is attended).

    q: ``[B, H, D]``; row ``b`` attends to cache positions ``0..seq_lens[b]-1`` (only the last
    ``sliding_window`` of them when given). ``num_splits``
    None picks one from ``max_seq_len`` (a host int; ``block_tables`` width is the bound when
    omitted). Any split count is correct for any lengths; it only changes parallelism, so a
    CUDA graph captured with a fixed count stays valid.
    """
    _check_caches(k_cache, v_cache, k_scale, v_scale)
    q = _unit_inner(q)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
        num_splits = choose_num_splits(num_seqs, num_kv_heads, bound, _device_sm_count(q.device))
    split = num_splits > 1
    part_lse, part_acc = (_split_workspace(num_seqs, num_heads, num_splits, head_dim, q.device)
                          if split else (out, out))  # unused without splits
    ks, vs, *scale_strides = _scale_args(k_cache, k_scale, v_scale)
    sink_arg = sinks if sinks is not None else out  # unread without SINKS
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_lse, part_acc, ks, vs, sink_arg,
        scale * _LOG2E, num_splits, num_heads, sliding_window or 0, attention_chunk_size or 0,
        (softcap or 0.0) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *scale_strides, QUANT=k_scale is not None,
        **decode_launch_options(group, head_dim, page, q.dtype, split, block_n, softcap is not None,
                                sinks is not None), **pdl.launch_options(q.device))
    if split:
        merge_splits(part_lse, part_acc, out, sinks, num_splits)
    return out


def merge_splits(part_lse: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None,
                 num_splits: int) -> None:
    """Combine flash-decoding partial results (``_split_workspace``'s layout) into ``out``
    ``[B, H, D]``, folding in the per-head ``sinks`` when given."""
    num_seqs, num_heads, head_dim = out.shape
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_lse, part_acc, out, sinks if sinks is not None else out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=triton.next_power_of_2(num_splits), SINKS=sinks is not None, num_warps=4,
        **pdl.launch_options(out.device))


# --------------------------------------------------------------------------------------
# Prefill / extend / mixed
# --------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr,
                    context_lens_ptr, work_ptr, out_ptr, ks_ptr, vs_ptr, sinks_ptr, qk_scale, window,
                    chunk_size, softcap_l2,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt,
                    stride_sb, stride_ss, stride_sh,
                    GROUP: tl.constexpr, HEAD_CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr,
                    TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, QUANT: tl.constexpr,
                    SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    # One work item = (sequence, query tile); see _prefill_work for why and in what order.
    item = tl.program_id(0).to(tl.int64)
    seq = tl.load(work_ptr + 2 * item)
    tile = tl.load(work_ptr + 2 * item + 1)
    kv_head = tl.program_id(1) // N_CHUNKS
    chunk = tl.program_id(1) % N_CHUNKS
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    tok_lo = tile * TOKENS
    ctx = tl.load(context_lens_ptr + seq)

    # Row r is token tok_lo + r // HEAD_CHUNK of head r % HEAD_CHUNK (within this chunk of the
    # group): the heads sharing a KV head share every K/V tile.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tok_lo + offs_m // HEAD_CHUNK
    head_in_group = chunk * HEAD_CHUNK + offs_m % HEAD_CHUNK
    row_mask = (offs_m < TOKENS * HEAD_CHUNK) & (head_in_group < GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + head_in_group
    q_rows = (q_start + tok).to(tl.int64)
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys below `full_end` are visible to every row (the first row sees 0..ctx+tok_lo), so
    # those tiles skip the causal mask; the rest, up to the last row's position, apply it.
    kv_end = ctx + tl.minimum(tok_lo + TOKENS, q_len)
    full_end = ((ctx + tok_lo + 1) // BLOCK_N) * BLOCK_N
    # A sliding window (window > 0): row r sees keys q_pos - window < pos <= q_pos. Tiles
    # before the first row's window are skipped and every tile applies the mask.
    first_key = tl.where(window > 0, tl.maximum(ctx + tok_lo - window + 1, 0), 0)
    # Chunked attention (chunk_size > 0): row r sees keys from the start of its chunk; the
    # first row's chunk starts first.
    chunk_div = tl.maximum(chunk_size, 1)
    first_key = tl.where(chunk_size > 0, tl.maximum(first_key, (ctx + tok_lo) // chunk_div * chunk_size),
                         first_key)
    kv_lo = (first_key // BLOCK_N) * BLOCK_N
    full_end = tl.where((window > 0) | (chunk_size > 0), kv_lo, full_end)
    for start in range(kv_lo, full_end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < kv_end
        offs = _kv_offsets(bt_row, pos, n_mask, kv_head, stride_cb, stride_cs, stride_ch, PAGE)
        k = tl.load(k_cache_ptr + offs[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + offs[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        ks, vs = _load_scales(ks_ptr, vs_ptr, bt_row, pos, n_mask, kv_head, stride_sb, stride_ss,
                              stride_sh, PAGE, QUANT)
        m_i, l_i, acc = _online_softmax_step(q, k.to(q.dtype), v.to(q.dtype), n_mask[None, :],
                                             m_i, l_i, acc, qk_scale, ks, vs, softcap_l2, False, PRECISION,
                                             QUANT, SOFTCAP)
    for start in range(full_end, kv_end, BLOCK_N):
        pos = start + offs_n
        n_mask = (pos < kv_end) & (pos >= first_key)  # keys before every row's window stay unread
        offs = _kv_offsets(bt_row, pos, n_mask, kv_head, stride_cb, stride_cs, stride_ch, PAGE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        causal = causal & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        causal = causal & ((chunk_size <= 0) | (pos[None, :] >= q_pos[:, None] // chunk_div * chunk_size))
        ks, vs = _load_scales(ks_ptr, vs_ptr, bt_row, pos, n_mask, kv_head, stride_sb, stride_ss,
                              stride_sh, PAGE, QUANT)
        m_i, l_i, acc = _online_softmax_step(q, k.to(q.dtype), v.to(q.dtype), causal,
                                             m_i, l_i, acc, qk_scale, ks, vs, softcap_l2, True, PRECISION, QUANT,
                                             SOFTCAP)

    if SINKS:
        l_i, acc = _fold_sinks(sinks_ptr, heads, row_mask, m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out, mask=io_mask)


def prefill_launch_options(group: int, head_dim: int, page: int, dtype: torch.dtype,
                           block_m: int | None = None, block_n: int | None = None,
                           quant: bool = False, softcap: bool = False, sinks: bool = False) -> dict:
    """Constexprs and launch settings of ``_prefill_kernel`` (also used by the compile test).

    ``block_m``/``block_n`` override the tile shape (tests, tuning); ``quant``: an int8/fp8
    cache, whose conversions and scale vectors need more registers (8 warps, 2 stages keep
    the tiles without spilling on sm_90).
    """
    d_pad = triton.next_power_of_2(head_dim)
    if _interpreting():
        cfg = (32, 32, 4, 1)  # small tiles keep the interpreter's numpy work small
    elif d_pad <= 64:
        cfg = (128, 64, 4, 3)
    elif d_pad <= 128:
        cfg = (128, 64, 8, 2)
    else:
        # D=256: a [64, 256] fp32 accumulator already takes 64 registers per thread at 8 warps.
        cfg = (64, 32, 8, 2)
    if quant and not _interpreting():
        cfg = (cfg[0], cfg[1], 8, 2)
    block_m, block_n = block_m or cfg[0], block_n or cfg[1]
    # A tile's rows are (token, head) pairs over up to block_m heads of one group; a group
    # wider than the tile is split over several programs.
    head_chunk = min(group, block_m)
    return dict(
        GROUP=group, HEAD_CHUNK=head_chunk, N_CHUNKS=triton.cdiv(group, head_chunk),
        TOKENS=block_m // head_chunk, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=cfg[2], num_stages=cfg[3], QUANT=quant,
        SOFTCAP=softcap, SINKS=sinks, **_dot_options(dtype))


def _prefill_work(meta: AttentionMetadata, tokens_per_tile: int,
                  device: torch.device) -> torch.Tensor:
    """``[items, 2]`` int32 (sequence, query tile) pairs, heaviest first, built on the host.

    A grid of ``max_query_len`` tiles for every sequence would be mostly empty in the usual
    continuous-batching step (hundreds of one-token decodes beside one long prefill chunk),
    and every empty program still costs a launch slot in every layer. Listing only real tiles
    avoids that. Tiles that see the most keys go first so the longest programs do not form
    the tail of the grid. Built once per step and cached on the metadata, which all layers
    share; the host lists mean no device sync.
    """
    cache = meta.__dict__.setdefault("_triton_prefill_work", {})
    key = (tokens_per_tile, str(device))
    if key not in cache:
        q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
        ctx = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64) - q_lens
        tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
        seq = torch.repeat_interleave(torch.arange(len(q_lens)), tiles)
        first = torch.cumsum(tiles, 0) - tiles
        tile = torch.arange(seq.numel()) - first[seq]
        keys_seen = ctx[seq] + torch.minimum((tile + 1) * tokens_per_tile, q_lens[seq])
        order = torch.argsort(keys_seen, descending=True, stable=True)
        work = torch.stack((seq[order], tile[order]), dim=1).to(torch.int32)
        if device.type == "cuda":  # pinned, so the copy does not stall the host
            work = work.pin_memory().to(device, non_blocking=True)
        cache[key] = work
    return cache[key]


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float,
                            out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            sliding_window: int | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None,
                            attention_chunk_size: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged prefix and themselves
    (``k_scale`` and ``v_scale`` for an int8/fp8 cache; ``softcap`` caps the scores; ``sinks``
    per-head sink logits; ``attention_chunk_size``: each token sees only its own chunk).

    q: ``[T, H, D]`` flattened by ``meta.query_start_loc``; the new K/V must already be in
    the cache. Correct for any query lengths (1 included) and any ``context_lens``; with
    ``sliding_window`` a token sees only the last ``sliding_window`` positions up to itself.
    ``block_m``/``block_n`` override the tile shape (tests, tuning).
    """
    _check_caches(k_cache, v_cache, k_scale, v_scale)
    q = _unit_inner(q)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    opts = prefill_launch_options(group, head_dim, page, q.dtype, block_m, block_n, k_scale is not None,
                                  softcap is not None, sinks is not None)
    work = _prefill_work(meta, opts["TOKENS"], q.device)
    if work.shape[0] == 0:
        return out
    ks, vs, *scale_strides = _scale_args(k_cache, k_scale, v_scale)
    _prefill_kernel[(work.shape[0], num_kv_heads * opts["N_CHUNKS"])](
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, work, out,
        ks, vs, sinks if sinks is not None else out, scale * _LOG2E, sliding_window or 0, attention_chunk_size or 0,
        (softcap or 0.0) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        *scale_strides, **opts)
    return out
