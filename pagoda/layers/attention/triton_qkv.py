"""From a decoder layer's qkv projection to the paged cache in one Triton launch.

``prepare_qkv`` does what four launches did before (q norm, k norm, rotary, ``write_kv``):
per-head RMS norm of q and k (optional: the qk-norm families), NeoX rotary of q and k at each
token's position (partial rotary too), and the write of the rotated k and of v into the cache
(quantized with one scale per token and head for an int8/fp8 cache, as ``write_kv`` does). A
batch-1 decode step spends more on launching small kernels than on running them, so the three
launches saved a layer are a step's time on small models.

One program per (token, head) of q and k: the program of a k head also writes its v head. The
arithmetic rounds where the unfused ops round (after the norm, after the rotation), so both
paths give the same values to within the order of a sum. On a host without CUDA the kernel runs
under Triton's interpreter, as the tests do.
"""
from __future__ import annotations

import torch

from pagoda.kernels.triton_import import HAS_TRITON, tl, triton
from pagoda.layers import pdl

if HAS_TRITON:
    from pagoda.layers.attention.triton_kernels import (_check_caches, _quantize_rows, _scale_args,
                                                        write_kv_quant_options)

    @triton.jit
    def _load_piece(row_ptr, offs, mask, w_ptr, rstd, NORM: tl.constexpr):
        """A piece of a head, normed (and rounded to the activation dtype) when NORM."""
        x = tl.load(row_ptr + offs, mask=mask, other=0.0)
        if NORM:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd * w).to(row_ptr.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _store_row(src_ptr, cache_ptr, scale_ptr, dst, scale_dst, keep,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                   IS_INT: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
        """One head row ``[1, D]`` from ``src_ptr`` into the cache at ``dst`` (quantized when QUANT)."""
        offs = tl.arange(0, D_PAD)[None, :]
        mask = keep[:, None] & (offs < HEAD_DIM)
        x = tl.load(src_ptr + offs, mask=mask, other=0.0)
        if QUANT:
            x, scale = _quantize_rows(x, mask, QMAX, IS_INT, MANT, MIN_EXP)
            tl.store(scale_ptr + scale_dst + tl.zeros([1], tl.int64), scale, mask=keep)
        tl.store(cache_ptr + dst + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _prepare_qkv_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            ks_ptr, vs_ptr, stride_t, stride_cos, stride_cb, stride_cs, stride_ch,
                            stride_sb, stride_ss, stride_sh, num_heads, num_kv_heads, eps,
                            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr,
                            HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, NORM: tl.constexpr,
                            PAGE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                            MANT: tl.constexpr, MIN_EXP: tl.constexpr, PDL: tl.constexpr = False):
        pdl.pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)  # q heads first, then k heads: both at column h * HEAD_DIM
        row = qkv_ptr + t * stride_t + h * HEAD_DIM
        offs = tl.arange(0, HALF_PAD)
        mask = offs < HALF
        rstd = 0.0
        if NORM:
            x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
            squares = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
            if PASS_PAD > 0:
                tail = 2 * HALF + tl.arange(0, PASS_PAD)
                x3 = tl.load(row + tail, mask=tail < HEAD_DIM, other=0.0).to(tl.float32)
                squares += tl.sum(x3 * x3, axis=0)
            rstd = tl.rsqrt(squares / HEAD_DIM + eps)
        is_q = h < num_heads
        w_ptr = qw_ptr
        if not is_q:
            w_ptr = kw_ptr
        x1 = _load_piece(row, offs, mask, w_ptr, rstd, NORM)
        x2 = _load_piece(row + HALF, offs, mask, w_ptr + HALF, rstd, NORM)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        out_ty = qkv_ptr.dtype.element_ty
        tl.store(row + offs, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
        tl.store(row + HALF + offs, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
        if PASS_PAD > 0 and NORM:  # partial rotary: the unrotated tail is still normed
            tail = 2 * HALF + tl.arange(0, PASS_PAD)
            x3 = _load_piece(row, tail, tail < HEAD_DIM, w_ptr, rstd, NORM)
            tl.store(row + tail, x3.to(out_ty), mask=tail < HEAD_DIM)
        if not is_q:
            # The row as stored (every thread's part of it) goes to the cache, beside its v row.
            tl.debug_barrier()
            head = h - num_heads
            slot = tl.load(slot_ptr + t).to(tl.int64)
            # A negative slot marks a padding token: nothing is written.
            keep = (tl.zeros([1], tl.int64) + slot) >= 0
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + head * stride_ch
            scale_dst = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + head * stride_sh
            _store_row(row, k_cache_ptr, ks_ptr, dst, scale_dst, keep, HEAD_DIM, D_PAD, QUANT, QMAX, IS_INT,
                       MANT, MIN_EXP)
            v_row = qkv_ptr + t * stride_t + (num_heads + num_kv_heads + head) * HEAD_DIM
            _store_row(v_row, v_cache_ptr, vs_ptr, dst, scale_dst, keep, HEAD_DIM, D_PAD, QUANT, QMAX, IS_INT,
                       MANT, MIN_EXP)


def prepare_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm (when ``q_norm``/``k_norm`` weights are given) and rotate q and k of ``qkv``
    ``[T, (H + 2 Hkv) * D]`` in place, and write the rotated k and v into the caches at
    ``slot_mapping`` (-1 skips). Returns q ``[T, H, D]``, k and v ``[T, Hkv, D]``, views of
    ``qkv``. ``cos_sin_cache[p]`` is ``[cos | sin]`` over the rotary width (``fused_ops``)."""
    _check_caches(k_cache, v_cache, k_scale, v_scale)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("prepare_qkv: q and k are normed together or not at all")
    t = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"prepare_qkv: qkv {tuple(qkv.shape)} is not [T, (H + 2 Hkv) * D] with a unit inner stride")
    if slot_mapping.shape[0] != t or positions.shape != (t,):
        raise ValueError("prepare_qkv: positions and slot_mapping need one entry a token")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    rot = cos_sin_cache.shape[-1]
    half, tail = rot // 2, head_dim - rot
    if t > 0:
        scales = _scale_args(k_cache, k_scale, v_scale)
        _prepare_qkv_kernel[(t, num_heads + num_kv_heads)](
            qkv, positions, cos_sin_cache, q_norm if q_norm is not None else qkv,
            k_norm if k_norm is not None else qkv, k_cache, v_cache, slot_mapping, scales[0], scales[1],
            qkv.stride(0), cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *scales[2:], num_heads, num_kv_heads, eps,
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), PASS_PAD=triton.next_power_of_2(tail) if tail > 0 else 0,
            NORM=q_norm is not None, PAGE=k_cache.shape[1], **write_kv_quant_options(k_cache.dtype),
            num_warps=1 if head_dim <= 128 else 2, **pdl.launch_options(qkv.device))
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim))
