"""The paged decode-attention kernel (csrc/attention.h, attention.cpp) from Python.

The torch path must gather every sequence's K/V into a fresh tensor before attending, so a
decode step copies the whole cache once per layer and reads it twice more. This kernel reads
each sequence's K/V in place through its block table, once, computing every query head of a
K/V group from the same row; when there are fewer sequences than threads, a long sequence's
positions are split over the threads (each reading whole slots for every head) and the parts'
softmax sums merged. It serves float32 decode rows over a float32, bfloat16 or float16 cache or a quantized
(int8/fp8, per-token-head scales) one, which it dequantizes in its loop, never as a copy; rows
of a 16-bit model over a quantized cache are converted to float32 for it. Anything else (or a
machine where the kernel library is unavailable, or ``PAGODA_CPU_KERNELS=0``) keeps the torch path.

At head sizes 64 and 128 over a float32, bfloat16 or float16 cache (``attend_heads``, nearly every
model; in the AVX-512 and the AVX2 variants, sixteen or eight lanes)
the work is arranged for the vector units instead: each query head keeps its q row, then its
output row, in registers across all positions (the group's first head reads the K/V rows from
memory, fetched a few positions ahead; the others find them in L1/L2), the scores of sixteen
positions are summed together, and the softmax uses a vectorised exp. In a batch-32 bfloat16
decode step this was the largest cost after the matmuls: the general loops spent half their time
waiting for K/V rows and the rest on one horizontal sum, one scalar exp and a load and store of
the output row per position and head.
"""
from __future__ import annotations


import torch

from pagoda.kernels.build import Kernel



_KERNEL = Kernel("attention", "CPU paged-attention kernel", "using the torch path")


def load() -> object | None:
    """The kernel library's op namespace, or None when the kernel cannot run here (the torch path
    is used)."""
    return _KERNEL.load()


# Caches read as they are (no scales): a float32, bfloat16 or float16 model's.
_FLOAT_CACHES = (torch.float32, torch.bfloat16, torch.float16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its ``seq_lens`` cached tokens (only the
    last ``sliding_window`` of them when given); an int8/fp8 cache comes with its scales
    (``kv_quant.py``); ``softcap``: scores become ``softcap * tanh(score / softcap)``."""
    ops = load()
    assert ops is not None
    if (k_scale is None) != (k_cache.dtype in _FLOAT_CACHES) or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_decode: a float32, bfloat16 or float16 cache has no scales, an int8/fp8 cache needs them, "
                         "and K and V share strides")
    if k_scale is not None and (v_scale is None or k_scale.stride() != v_scale.stride()):
        raise ValueError("paged_decode: k_scale and v_scale must both be given, with the same strides")
    dtype = q.dtype
    q = q.float().contiguous()
    out = torch.empty_like(q)
    ops.paged_decode(out, q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale,
                     sliding_window or 0, k_scale, v_scale, float(softcap or 0.0))
    return out.to(dtype)


def usable(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None = None) -> bool:
    """Whether ``paged_decode`` serves these rows: float32 over a float32 cache, bfloat16 or
    float16 over a cache of the same dtype (computed in float32), or any float dtype over a
    quantized cache (converted to float32 for the kernel)."""
    if q.device.type != "cpu" or k_cache.stride(-1) != 1:
        return False
    if k_scale is not None:
        ok = k_cache.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2) and q.is_floating_point()
    else:
        ok = q.dtype == k_cache.dtype and q.dtype in _FLOAT_CACHES
    return ok and load() is not None
