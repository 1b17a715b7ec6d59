"""The CPU grouped-expert kernel (``kernels/moe.py``, ``kernels/csrc/moe.cpp``) against computing every (token, expert)
pair alone: odd sizes (partial panels and vector tails), bfloat16 weights, experts with no rows,
an expert-parallel rank's slice, and a token's result not depending on its batch."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import moe as cpu_moe
from pagoda.kernels import select
from pagoda.layers.moe import FusedMoE, softmax_topk

pytestmark = pytest.mark.skipif(not select.kernels_enabled(), reason="PAGODA_CPU_KERNELS=0")


def _reference(x, weights, ids, w13, w2, first=0):
    """Each pair alone, in float64; pairs routed outside ``first .. first + E - 1`` add 0."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if not 0 <= e < w13.shape[0]:
                continue
            h = x[t].double() @ w13[e].double().T
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (act @ w2[e].double().T)
    return out


def _case(tokens, experts, hidden, inter, top_k, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = softmax_topk(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, weights, ids, w13, w2


@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k", [
    (1, 4, 64, 32, 2),     # one token: whole panels, two at a time
    (13, 7, 40, 24, 3),    # partial 16-wide panels on both products, an odd panel count
    (37, 5, 100, 70, 2),   # about fifteen rows per expert: past the two-panel tile's fourteen
    (80, 4, 64, 40, 2),    # about forty rows per expert: two even row tiles
    (150, 3, 48, 40, 2),   # about a hundred rows per expert: four row tiles of 25
])
def test_kernel_matches_each_pair_alone(tokens, experts, hidden, inter, top_k):
    x, weights, ids, w13, w2 = _case(tokens, experts, hidden, inter, top_k, seed=tokens)
    got = cpu_moe.moe_experts(x, weights, ids, *cpu_moe.pack_experts(w13, w2), 0, inter)
    torch.testing.assert_close(got.double(), _reference(x, weights, ids, w13, w2), rtol=1e-4, atol=1e-4)


def test_bfloat16_weights_are_widened_exactly():
    x, weights, ids, w13, w2 = _case(9, 6, 48, 40, 2, seed=3, dtype=torch.bfloat16)
    got = cpu_moe.moe_experts(x, weights, ids, *cpu_moe.pack_experts(w13, w2), 0, 40)
    torch.testing.assert_close(got.double(), _reference(x, weights, ids, w13, w2), rtol=1e-4, atol=1e-4)
    # bfloat16 activations come back in bfloat16
    assert cpu_moe.moe_experts(x.bfloat16(), weights, ids, *cpu_moe.pack_experts(w13, w2), 0, 40).dtype == torch.bfloat16


def test_experts_without_rows_and_an_expert_parallel_slice():
    x, weights, ids, w13, w2 = _case(6, 8, 32, 16, 2, seed=4)
    ids = ids % 3  # experts 3..7 receive nothing
    weights = weights.contiguous()
    full = cpu_moe.moe_experts(x, weights, ids, *cpu_moe.pack_experts(w13, w2), 0, 16)
    torch.testing.assert_close(full.double(), _reference(x, weights, ids, w13, w2), rtol=1e-4, atol=1e-4)
    # A rank holding experts 2..3 computes only the pairs routed to them.
    part = cpu_moe.moe_experts(x, weights, ids, *cpu_moe.pack_experts(w13[2:4], w2[2:4]), 2, 16)
    torch.testing.assert_close(part.double(), _reference(x, weights, ids, w13[2:4], w2[2:4], first=2),
                               rtol=1e-4, atol=1e-4)
    assert part.abs().sum() > 0 and not torch.equal(part, full)


def test_layer_takes_the_kernel_after_packing_and_rows_do_not_depend_on_the_batch():
    x, weights, ids, w13, w2 = _case(11, 6, 72, 36, 3, seed=5)
    moe = FusedMoE(6, 72, 36, torch.float32)
    moe.w13_weight.data, moe.w2_weight.data = w13.clone(), w2.clone()
    unpacked = moe(x, weights, ids)
    assert moe.pack_weight() and moe.panels is not None and moe.w13_weight.numel() == 0
    batched = moe(x, weights, ids)
    torch.testing.assert_close(batched, unpacked, rtol=1e-5, atol=1e-5)
    for t in range(11):
        assert torch.equal(moe(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), batched[t:t + 1])
