"""A dequantizing Triton matmul for int8 / int4 weights on GPUs (also run on CPU tensors under
``TRITON_INTERPRET=1`` by the tests).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile: it loads the quantized weight tile
(int8 values, or two 4-bit values per byte along K), dequantizes it in registers as
``scale[n, g] * (q - zero[n, g])`` and accumulates ``x @ w.T`` in float32. The dense weight is
never written to memory. int4 is stored ``[N, K/2]`` bytes, the low nibble holding the even
column.
"""
from __future__ import annotations

import torch

from pagoda.kernels.triton_import import HAS_TRITON, tl, triton


if HAS_TRITON:

    @triton.jit
    def _woq_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G,
                    stride_xm, stride_qn, stride_sn, stride_ym,
                    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0).to(tl.float32)
            w_mask = (offs_n[:, None] < N) & k_ok[None, :]
            if BITS == 4:
                byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // 2, mask=w_mask, other=0)
                q = ((byte.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
            else:
                q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=w_mask, other=0).to(tl.float32)
            g = offs_k[None, :] // GROUP
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g, mask=w_mask, other=0.0)
            if HAS_ZERO:
                q = q - tl.load(z_ptr + offs_n[:, None] * stride_sn + g, mask=w_mask, other=0.0)
            acc += tl.dot(x, tl.trans(q * s))
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


class TritonWoq:
    """``x @ (scales * (q - zeros)).T + bias`` with the weight dequantized tile by tile."""

    kernel = "triton"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                 bits: int, perm: torch.Tensor | None = None) -> None:
        n, k = q.shape
        self.n, self.k, self.bits, self.group_size, self.perm = n, k, bits, group_size, perm
        if bits == 4:
            u = q.to(torch.uint8)
            self.q = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
        else:
            self.q = q.to(torch.int8).contiguous()
        self.scales = scales.to(torch.float32).reshape(n, -1).contiguous()
        self.zeros = None if zeros is None else zeros.to(torch.float32).reshape(n, -1).contiguous()

    @property
    def nbytes(self) -> int:
        tensors = [self.q, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x[..., self.perm]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k).contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32, device=x.device)
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(self.n, 64))
        zeros = self.zeros if self.zeros is not None else self.scales
        _woq_kernel[grid](x2, self.q, self.scales, zeros, y, m, self.n, self.k, self.scales.shape[1],
                          x2.stride(0), self.q.stride(0), self.scales.stride(0), y.stride(0),
                          GROUP=self.group_size, BITS=self.bits, HAS_ZERO=self.zeros is not None,
                          BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)
        y = y.to(x.dtype).view(*lead, self.n)
        return y + bias if bias is not None else y
