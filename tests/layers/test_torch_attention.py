"""The torch attention backend on mixed steps: decodes, fresh prompts and later chunks of
different lengths in one batch, each against attention computed directly in float64 from the
sequence's full K/V (no paging, no padding)."""
from __future__ import annotations

import math

import pytest
import torch

from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.layers.attention.torch_backend import TorchAttentionBackend

H, HKV, D, BS = 4, 2, 16, 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions ctx..ctx+n-1 over k, v [ctx+n, HKV, D]."""
    q, k, v = q.double(), k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    n, total = q.shape[0], k.shape[0]
    visible = torch.arange(total)[None, :] <= (ctx + torch.arange(n))[:, None]
    weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


@pytest.mark.parametrize("cases", [
    [(0, 7), (11, 5), (20, 1), (0, 3)],  # (context, new tokens): prompts, a later chunk, a decode
    [(0, 9), (0, 2)],                     # two fresh prompts of different lengths
    [(5, 6)],                             # one chunk after a cached prefix
])
def test_mixed_step_matches_direct_attention(cases: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    blocks_per_seq = 8
    k_cache = torch.zeros(len(cases) * blocks_per_seq, BS, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[b * blocks_per_seq + i for i in range(blocks_per_seq)] for b in range(len(cases))],
                          dtype=torch.int32)
    full_k, full_v, slots, qs = [], [], [], []
    for b, (ctx, n) in enumerate(cases):
        fk, fv = torch.randn(ctx + n, HKV, D), torch.randn(ctx + n, HKV, D)
        full_k.append(fk)
        full_v.append(fv)
        for pos in range(ctx):  # the prefix is already cached
            blk, off = tables[b, pos // BS], pos % BS
            k_cache[blk, off], v_cache[blk, off] = fk[pos], fv[pos]
        slots += [int(tables[b, p // BS]) * BS + p % BS for p in range(ctx, ctx + n)]
        qs.append(torch.randn(n, H, D))
    q = torch.cat(qs)
    k = torch.cat([fk[ctx:] for fk, (ctx, _) in zip(full_k, cases)])
    v = torch.cat([fv[ctx:] for fv, (ctx, _) in zip(full_v, cases)])
    qlens = [n for _, n in cases]
    seq_lens = [c + n for c, n in cases]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in cases], dtype=torch.int32), block_tables=tables,
        max_query_len=max(qlens), max_seq_len=max(seq_lens), query_lens_cpu=qlens, seq_lens_cpu=seq_lens)
    scale = D ** -0.5
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    for b, (ctx, n) in enumerate(cases):
        expected = _reference(q[starts[b]:starts[b + 1]], full_k[b], full_v[b], ctx, scale)
        torch.testing.assert_close(out[starts[b]:starts[b + 1]].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_decode_group_ignores_garbage_past_each_sequence(monkeypatch, window) -> None:
    """Decodes of different lengths batched through the torch path (the C++ kernel set aside):
    the shorter sequences' gathered rows run into slots holding NaN (a free block, block 0 of the
    padded table); their outputs stay finite and exact."""
    from pagoda.kernels import attention as cpu_kernel

    monkeypatch.setattr(cpu_kernel, "usable", lambda *args, **kwargs: False)
    torch.manual_seed(1)
    lens = [13, 2, 6]
    k_cache = torch.full((12, BS, HKV, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.tensor([[1, 2, 3, 4], [5, 0, 0, 0], [6, 7, 0, 0]], dtype=torch.int32)
    full_k = [torch.randn(n, HKV, D) for n in lens]
    full_v = [torch.randn(n, HKV, D) for n in lens]
    for b, n in enumerate(lens):
        for pos in range(n - 1):
            blk, off = tables[b, pos // BS], pos % BS
            k_cache[blk, off], v_cache[blk, off] = full_k[b][pos], full_v[b][pos]
    slots = [int(tables[b, (n - 1) // BS]) * BS + (n - 1) % BS for b, n in enumerate(lens)]
    q = torch.randn(len(lens), H, D)
    k = torch.stack([fk[-1] for fk in full_k])
    v = torch.stack([fv[-1] for fv in full_v])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), context_lens=torch.tensor([n - 1 for n in lens],
                                                                                   dtype=torch.int32),
        block_tables=tables, max_query_len=1, max_seq_len=max(lens), query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens)
    scale = D ** -0.5
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window=window)
    assert not out.isnan().any()
    for b, n in enumerate(lens):
        first = 0 if window is None else max(n - window, 0)  # the window's keys only
        expected = _reference(q[b:b + 1], full_k[b][first:], full_v[b][first:], n - 1 - first, scale)
        torch.testing.assert_close(out[b:b + 1].double(), expected, rtol=1e-5, atol=1e-5)
