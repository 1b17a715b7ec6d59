"""Dynamic per-token fp8 (e4m3) quantization of activations in one Triton kernel per matrix
(the W8A8 path's input side on GPUs; ``fp8_w8a8.py``). Also run on CPU tensors under
``TRITON_INTERPRET=1`` by the tests.

Each program owns one row: it reads the row once for ``amax = max |x|``, writes
``scale = max(amax, 1e-12) / 448`` and then ``x / scale`` clamped to +-448 and rounded to the
nearest e4m3 value (ties to even), exactly as ``fp8_w8a8.quantize_per_token_torch``. One kernel
instead of the six elementwise ops torch needs: at decode each linear layer's input is a few KB,
so the launches, not the bytes, are the cost.

The rounding to e4m3 is done in float32 arithmetic and the exactly representable result then
stored as fp8: the value is then the same whatever rounding the conversion instruction does
(Triton's interpreter, which the CPU tests run, rounds some values to the wrong binade).

Block-scaled weights (DeepSeek-V3's ``weight_block_size``, scales varying along K): the
activations are quantized per token and per group of ``group`` columns (``per_token_group_fp8``,
a scale per row and group), and ``block_fp8_matmul`` multiplies them by the fp8 weight tile by
tile with ``BLOCK_K`` equal to the group: each K step's fp8 product (float32 accumulation) is
scaled by its row's activation scale and its columns' weight scales before it is added, which is
the dequantized product exactly up to float32 rounding.
"""
from __future__ import annotations

import torch

from pagoda.kernels.triton_import import HAS_TRITON, tl, triton

FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale, not a division by zero

if HAS_TRITON:

    @triton.jit
    def _round_e4m3(v):
        """``v`` (|v| <= 448) rounded to the nearest float8 e4m3fn value, ties to even."""
        a = tl.abs(v)
        e = (a.to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2 a); a >= 0, so no sign bit
        e = tl.maximum(e, -6)  # below 2**-6 the subnormal step 2**-9 applies
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        r = a / step  # exact: a power of two
        f = tl.floor(r)
        d = r - f
        odd = (f.to(tl.int32) & 1) == 1
        up = (d > 0.5) | ((d == 0.5) & odd)
        q = (f + up.to(tl.float32)) * step
        return tl.where(v < 0, -q, q)

    @triton.jit
    def _per_token_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                              FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        scale = tl.maximum(tl.max(acc, axis=0), MIN_AMAX_C) / FP8_MAX_C
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            mask = offs < K
            x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
            v = _round_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX_C), FP8_MAX_C))
            tl.store(q_ptr + row * stride_qm + offs, v.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (last dim contiguous) -> ``(q [M, K] float8_e4m3fn, scales [M, 1] float32)``
    with ``x ~ scales * q`` row by row."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(k), 2048)
        _per_token_fp8_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), FP8_MAX, MIN_AMAX, BLOCK=block)
    return q, scales


if HAS_TRITON:

    @triton.jit
    def _per_token_group_fp8_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
                                    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, GROUP: tl.constexpr,
                                    GROUP_PAD: tl.constexpr):
        row = tl.program_id(0)
        for g in range(0, num_groups):
            offs = g * GROUP + tl.arange(0, GROUP_PAD)
            mask = (tl.arange(0, GROUP_PAD) < GROUP) & (offs < K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX_C) / FP8_MAX_C
            tl.store(s_ptr + row * stride_sm + g, scale)
            v = _round_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX_C), FP8_MAX_C))
            tl.store(q_ptr + row * stride_qm + offs, v.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _block_fp8_matmul_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                                 stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 UPCAST: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + offs_k
            k_mask = k < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                        other=0.0)
            if UPCAST:  # the interpreter has no fp8 products: exact float32 operands instead
                a, w = a.to(tl.float32), w.to(tl.float32)
            part = tl.dot(a, w, out_dtype=tl.float32)
            a_scale = tl.load(as_ptr + offs_m * stride_asm + kb, mask=m_mask, other=0.0)
            w_scale = tl.load(ws_ptr + offs_n * stride_wsn + kb, mask=n_mask, other=0.0)
            acc += part * a_scale[:, None] * w_scale[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def per_token_group_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> ``(q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32)``: each
    row's groups of ``group`` columns quantized as ``per_token_fp8`` quantizes a row."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _per_token_group_fp8_kernel[(m,)](x, q, scales, k, groups, x.stride(0), q.stride(0), scales.stride(0),
                                          FP8_MAX, MIN_AMAX, GROUP=group, GROUP_PAD=triton.next_power_of_2(group))
    return q, scales


def block_matmul_options(m: int, group: int) -> dict:
    """Tiles and launch settings of ``_block_fp8_matmul_kernel`` for ``m`` rows (also the compile
    test's): decode-sized batches take 16-row tiles, larger ones 64."""
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=group, num_warps=4, num_stages=1)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if block_m == 64:  # a [64, 128] float32 accumulator spills at 4 warps on sm_90
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=group, num_warps=8, num_stages=3)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=group, num_warps=4, num_stages=3)


def block_fp8_matmul(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                     group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``a`` ``[M, K]`` fp8 with ``a_scales`` ``[M, G]`` times ``w`` ``[N, K]`` fp8 with ``w_scales``
    ``[N, G]`` (``G = ceil(K / group)``, one scale per row and K group): ``[M, N]`` of
    ``sum_g (a_g . w_g) * a_scales[:, g] * w_scales[:, g]`` in ``out_dtype``."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    opts = block_matmul_options(m, group)
    grid = (triton.cdiv(m, opts["BLOCK_M"]), triton.cdiv(n, opts["BLOCK_N"]))
    _block_fp8_matmul_kernel[grid](a, a_scales, w, w_scales, out, m, n, k, a.stride(0), a_scales.stride(0),
                                   w.stride(0), w_scales.stride(0), out.stride(0),
                                   UPCAST=bool(triton.knobs.runtime.interpret), **opts)
    return out

