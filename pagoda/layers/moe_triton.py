"""Fused mixture-of-experts on the GPU: a Triton grouped GEMM over (token, expert) pairs.

The torch path of ``FusedMoE`` reads each expert's token count on the host to slice its rows;
this path needs no host synchronisation (and launches a fixed grid), so its work is the same
shape every step:

1. ``align``: the ``P = T * k`` pairs are sorted by expert and each expert's run is padded to a
   multiple of ``BLOCK_M``; ``sorted_pairs`` (length ``P + E * (BLOCK_M - 1)``, padding = ``P``)
   lists pair ids block by block and ``block_expert`` names each block's expert (``E`` for an
   unused block). All of it is torch index arithmetic on the device.
2. ``_grouped_gemm_kernel`` with ``w13``: block ``b`` multiplies its pairs' token rows by
   expert ``block_expert[b]``'s ``[2I, H]`` weight into an intermediate ``[P, 2I]`` in pair order;
   SiLU-and-mul makes it ``[P, I]``.
3. The same kernel with ``w2`` and each pair's routing weight gives ``[P, H]``; each token's
   ``k`` rows are summed. Experts with biases (gpt-oss) add their expert's bias row in both
   products before the routing weight, and may bring their own gate activation.

On a host without CUDA it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the CPU tests check it against the torch path.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from pagoda.layers import fused_ops


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for the flattened pair ids ``ids [P]`` (see the module doc)."""
    p = ids.numel()
    capacity = p + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(capacity, block_m)
    # index_add_ rather than bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(ids, stable=True)
    first_of = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    sorted_ids = ids[order]
    slot = starts[sorted_ids] + torch.arange(p, device=ids.device) - first_of[sorted_ids]
    sorted_pairs = torch.full((num_blocks * block_m,), p, dtype=torch.int64, device=ids.device)
    sorted_pairs[slot] = order
    block_start = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)  # == num_experts past the end
    return sorted_pairs, block_expert.to(torch.int64)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, pair_weight_ptr, bias_ptr,
                         num_pairs, n, k_dim, rows_per_a,
                         stride_am, stride_we, stride_wn, stride_om, stride_be,
                         num_experts,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         WEIGHTED: tl.constexpr, BIAS: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    # An unused block (past every expert's padded run) has expert == num_experts: its pair
    # slots all hold the padding id, so every load and store below is masked off.
    expert = tl.minimum(expert, num_experts - 1)
    offs_m = tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + offs_m)
    m_mask = pairs < num_pairs
    # token row (w13) or pair row (w2); an int32 division (a 64-bit one is a slow PTX subroutine)
    a_rows = (pairs.to(tl.int32) // rows_per_a).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = (k0 + offs_k) < k_dim
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:  # the interpreter multiplies 16-bit operands as raw integers
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if BIAS:  # the expert's own bias, before the routing weight (which scales its whole output)
        acc = acc + tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_mask, other=0.0)[None, :]
    if WEIGHTED:
        acc = acc * tl.load(pair_weight_ptr + pairs, mask=m_mask, other=0.0)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
                  num_pairs: int, rows_per_a: int, block_m: int, pair_weights: torch.Tensor | None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    num_experts, n, k_dim = w.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = (32, 32) if triton.knobs.runtime.interpret else (64, 64)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, pair_weights if pair_weights is not None else out,
        bias if bias is not None else out,
        num_pairs, n, k_dim, rows_per_a, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0, num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, WEIGHTED=pair_weights is not None, BIAS=bias is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=bool(triton.knobs.runtime.interpret), num_warps=8, num_stages=2)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, block_m: int = 16, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None,
                  activation: Callable[[torch.Tensor], torch.Tensor] = fused_ops.silu_and_mul) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for gated experts stacked as
    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, with optional per-expert biases ``[E, 2I]`` and
    ``[E, H]`` and the gate activation ``[P, 2I] -> [P, I]`` (SiLU-and-mul unless given); no
    host synchronisation."""
    t, k = ids.shape
    x = x.contiguous()
    sorted_pairs, block_expert = align(ids.reshape(-1), w13.shape[0], block_m)
    inter = _grouped_gemm(x, w13, sorted_pairs, block_expert, t * k, k, block_m, None, w13_bias)
    act = activation(inter).contiguous()
    out = _grouped_gemm(act, w2, sorted_pairs, block_expert, t * k, 1, block_m,
                        weights.reshape(-1).float().contiguous(), w2_bias)
    return out.view(t, k, -1).sum(dim=1)
