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
