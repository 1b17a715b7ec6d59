"""The MLA decode kernel (``triton_mla.py``, under Triton's interpreter on CPU) against a float64
reference of latent attention over the same paged cache: float and quantized caches, head
counts that leave a partial head tile, split contexts, an empty padding row; and its build for
sm_90 at DeepSeek-V3's shape without spills."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers.attention import kv_quant  # noqa: E402
from pagoda.layers.attention import triton_mla  # noqa: E402

NEEDS_TRITON = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4


def _paged_latent(gen: torch.Generator, seq_lens: list[int], dim: int, cache_dtype: torch.dtype):
    """A latent cache whose sequences own scattered blocks, its block table, the rows it holds
    (as read back: dequantized for int8/fp8) in sequence order, and the per-token scales."""
    blocks = [max(1, -(-n // PAGE)) for n in seq_lens]
    physical = torch.randperm(sum(blocks) + 3, generator=gen)
    rows = torch.randn(sum(blocks) + 3, PAGE, 1, dim, generator=gen)
    scale = None
    if kv_quant.is_quantized(cache_dtype):
        values, scale = kv_quant.quantize(rows, cache_dtype)
        cache, rows = values, kv_quant.dequantize(values, scale)
    else:
        cache = rows.to(cache_dtype)
        rows = cache.float()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used, per_seq = 0, []
    for b, n in enumerate(seq_lens):
        ids = physical[used:used + blocks[b]]
        used += blocks[b]
        table[b, :len(ids)] = ids.to(torch.int32)
        per_seq.append(rows[ids].reshape(-1, dim)[:n].double())
    return cache, table, per_seq, scale


def _reference(q: torch.Tensor, per_seq: list[torch.Tensor], scale: float, value_dim: int) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1], value_dim, dtype=torch.float64)
    for b, rows in enumerate(per_seq):
        if rows.shape[0]:
            p = torch.softmax(q[b].double() @ rows.T * scale, dim=-1)
            out[b] = p @ rows[:, :value_dim]
    return out


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.int8), (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("heads, value_dim, rope_dim", [(5, 24, 8), (20, 32, 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_matches_reference(dtype, cache_dtype, heads, value_dim, rope_dim, num_splits):
    gen = torch.Generator().manual_seed(heads * 7 + num_splits)
    seq_lens = [37, 1, 0, 70]  # the 0 is a padding row: its output is zeros
    cache, table, per_seq, cache_scale = _paged_latent(gen, seq_lens, value_dim + rope_dim, cache_dtype)
    q = torch.randn(len(seq_lens), heads, value_dim + rope_dim, generator=gen).to(dtype)
    scale = (value_dim + rope_dim) ** -0.5
    out = triton_mla.paged_mla_decode_attention(
        q.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        scale, value_dim, num_splits=num_splits, block_h=16,
        cache_scale=None if cache_scale is None else cache_scale.to(DEVICE))
    assert out.shape == (len(seq_lens), heads, value_dim) and out.dtype == dtype
    expected = _reference(q.float(), per_seq, scale, value_dim)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)
    assert torch.count_nonzero(out[2]) == 0


def test_mla_decode_refuses_mismatched_operands():
    cache = torch.zeros(4, PAGE, 1, 40)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree"):
        triton_mla.paged_mla_decode_attention(torch.zeros(1, 2, 36), cache, table, lens, 1.0, 32)
    with pytest.raises(ValueError, match="cache_scale"):
        triton_mla.paged_mla_decode_attention(torch.zeros(1, 2, 40), cache.to(torch.int8), table, lens, 1.0, 32)
    with pytest.raises(ValueError, match="latent cache"):
        triton_mla.paged_mla_decode_attention(torch.zeros(1, 2, 20), torch.zeros(4, PAGE, 2, 20), table, lens, 1.0,
                                              16)


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
