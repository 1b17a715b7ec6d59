"""The compiled CPU decode kernel against the torch paged-attention path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import attention as cpu_kernel
from pagoda.kernels import select
from pagoda.layers.attention import kv_quant

pytestmark = pytest.mark.skipif(not select.kernels_enabled(), reason="PAGODA_CPU_KERNELS=0")


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = [int(block_tables[b, t // bs]) * bs + t % bs for t in range(n)]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].transpose(0, 1)
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scale, enable_gqa=True)[:, 0]
    return out


@pytest.mark.parametrize("batch, heads, kv_heads, dim, block", [(1, 4, 4, 64, 16), (3, 8, 2, 32, 4),
                                                                 (9, 6, 1, 80, 16), (5, 4, 2, 16, 1)])
def test_decode_kernel_matches_reference(batch, heads, kv_heads, dim, block):
    gen = torch.Generator().manual_seed(batch * 100 + dim)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    seq_lens = torch.randint(1, 40, (batch,), generator=gen, dtype=torch.int32)
    width = -(-40 // block)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, dim, generator=gen)
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, dim ** -0.5)
    want = reference(q, k_cache, v_cache, block_tables, seq_lens, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim", [32, 64])  # the general loops and the vector path
def test_decode_kernel_reads_a_16_bit_cache(dtype, dim):
    """A bfloat16 or float16 model's cache and queries: the kernel widens each cached row and
    computes in float32, against the float32 reference over the same (16-bit) values; the output
    comes back in the model's dtype (one rounding: half a unit in its last place)."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, block, num_blocks = 3, 8, 2, 4, 32
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, 17, 30], dtype=torch.int32)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:8] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    assert cpu_kernel.usable(q, k_cache) and not cpu_kernel.usable(q.float(), k_cache)
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, dim ** -0.5)
    want = reference(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, dim ** -0.5)
    assert got.dtype == dtype
    atol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0, atol=atol)


# --------------------------------------------------------------------------------------
# Quantized caches (int8 / fp8 with per-token-head scales): the kernel reads them in place
# --------------------------------------------------------------------------------------

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def quantized_cache(gen, num_blocks, block, kv_heads, dim, dtype):
    x = torch.randn(num_blocks, block, kv_heads, dim, generator=gen) * 3
    x[0, 0, 0] = 0.0  # an all-zero head vector: its scale must not turn it into NaN
    return kv_quant.quantize(x, dtype)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
@pytest.mark.parametrize("batch, heads, kv_heads, dim, block", [(3, 8, 2, 32, 4), (9, 6, 1, 80, 16),
                                                                 (2, 4, 4, 64, 1)])
def test_decode_kernel_reads_quantized_cache(dtype, batch, heads, kv_heads, dim, block):
    """Against the float reference over the *dequantized* cache: the kernel's only difference
    is that it dequantizes inside its loop (scale folded into scores and probabilities)."""
    gen = torch.Generator().manual_seed(batch * 10 + dim)
    num_blocks = 48
    k_cache, k_scale = quantized_cache(gen, num_blocks, block, kv_heads, dim, dtype)
    v_cache, v_scale = quantized_cache(gen, num_blocks, block, kv_heads, dim, dtype)
    seq_lens = torch.randint(1, 40, (batch,), generator=gen, dtype=torch.int32)
    width = -(-40 // block)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, dim, generator=gen)
    assert cpu_kernel.usable(q, k_cache, k_scale)
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, dim ** -0.5, k_scale=k_scale,
                                  v_scale=v_scale)
    want = reference(q, kv_quant.dequantize(k_cache, k_scale), kv_quant.dequantize(v_cache, v_scale),
                     block_tables, seq_lens, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A bf16 model's rows go through the same kernel (converted to float32 and back).
    half = cpu_kernel.paged_decode(q.bfloat16(), k_cache, v_cache, block_tables, seq_lens, dim ** -0.5,
                                   k_scale=k_scale, v_scale=v_scale)
    assert half.dtype == torch.bfloat16
    want_half = reference(q.bfloat16().float(), kv_quant.dequantize(k_cache, k_scale),
                          kv_quant.dequantize(v_cache, v_scale), block_tables, seq_lens, dim ** -0.5)
    torch.testing.assert_close(half.float(), want_half, rtol=1e-2, atol=1e-2)  # bf16 rounding of the output


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_decode_kernel_decodes_every_fp8_value(dtype):
    """One cached token: the output is that token's V, so every finite fp8 byte placed in V
    must come back as torch's own conversion of it (times the scale), to a few ulps."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype)
    finite = codes[torch.isfinite(codes.float())]
    dim = finite.numel()
    v_cache = finite.view(1, 1, 1, dim)
    k_cache = torch.zeros(1, 1, 1, dim).to(dtype)
    scale = torch.tensor([[[0.5]]], dtype=torch.bfloat16)
    q = torch.randn(1, 2, dim)
    out = cpu_kernel.paged_decode(q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), 1.0, k_scale=scale, v_scale=scale.clone())
    want = (finite.float() * 0.5).expand(2, -1)
    # A few ulps for -ffast-math's division; neighbouring fp8 values are 2^-4 (relative) apart.
    torch.testing.assert_close(out[0], want, rtol=1e-6, atol=0)


def test_decode_kernel_refuses_missing_scales():
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs them"):
        cpu_kernel.paged_decode(torch.zeros(1, 1, 8), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.ones(1, dtype=torch.int32), 1.0)


def windowed_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window):
    """The reference over each sequence's last ``window`` keys (all of them when 0)."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        lo = n - window if window and n > window else 0
        slots = [int(block_tables[b, t // bs]) * bs + t % bs for t in range(lo, n)]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].transpose(0, 1)
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scale, enable_gqa=True)[:, 0]
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("batch, window", [(1, 0), (1, 150), (2, 0)])
def test_few_sequences_split_their_keys_over_the_threads(cache_dtype, batch, window):
    """Fewer sequences than threads, hundreds of keys each: the kernel gives each thread every
    head over a share of the positions (split-K) and merges the parts, which must equal the
    one-pass result (and the reference) whatever the split. Two threads here, so one sequence
    of at least 128 attended keys splits; a batch of two (700 and 100 keys) takes the other
    path, items per sequence and head group."""
    gen = torch.Generator().manual_seed(batch * 7 + window)
    heads, kv_heads, dim, block, num_blocks = 8, 2, 64, 16, 64
    k32 = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    v32 = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    scales = {}
    if cache_dtype == torch.int8:
        (k_cache, k_scale), (v_cache, v_scale) = kv_quant.quantize(k32, cache_dtype), kv_quant.quantize(v32, cache_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        k_ref, v_ref = kv_quant.dequantize(k_cache, k_scale), kv_quant.dequantize(v_cache, v_scale)
    else:
        k_cache, v_cache = k32.to(cache_dtype), v32.to(cache_dtype)
        k_ref, v_ref = k_cache.float(), v_cache.float()
    seq_lens = torch.tensor([700, 100][:batch], dtype=torch.int32)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:44] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, dim, generator=gen)
    if cache_dtype == torch.bfloat16:
        q = q.bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_kernel.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, dim ** -0.5, window or None,
                                      **scales)
        torch.set_num_threads(1)  # one pass per sequence: the parts must merge to the same numbers
        one = cpu_kernel.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, dim ** -0.5, window or None,
                                      **scales)
    finally:
        torch.set_num_threads(threads)
    want = windowed_reference(q.float(), k_ref, v_ref, block_tables, seq_lens, dim ** -0.5, window)
    tol = dict(rtol=0, atol=2 ** -7) if cache_dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), want.to(got.dtype).float(), **tol)
    torch.testing.assert_close(got.float(), one.float(), rtol=1e-5, atol=1e-5)
