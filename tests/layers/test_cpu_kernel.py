"""The compiled CPU decode kernel against the torch paged-attention path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.attention import cpu_kernel

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C++ toolchain to build the CPU kernel")


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
