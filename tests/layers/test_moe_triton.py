"""The Triton grouped-GEMM experts (GPU path of FusedMoE) against the torch grouped path, under
the interpreter on CPU: uneven expert loads, unused experts, one token, more pairs than a block."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers import moe_triton  # noqa: E402
from pagoda.layers.moe import FusedMoE, softmax_topk  # noqa: E402

NEEDS_TRITON = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_lists_every_pair_once_in_expert_blocks():
    ids = torch.tensor([3, 0, 3, 3, 1, 0, 3])
    sorted_pairs, block_expert = moe_triton.align(ids, 5, 2)
    blocks = sorted_pairs.view(-1, 2)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        real = [p for p in blocks[b].tolist() if p < len(ids)]
        if expert == 5:
            assert real == []
        seen += real
        assert all(int(ids[p]) == expert for p in real)
    assert sorted(seen) == list(range(len(ids)))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (13, 6, 3), (40, 5, 1)])
def test_fused_experts_match_torch_path(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    moe = FusedMoE(experts, 24, 20, torch.float32)
    moe.w13_weight.data = (torch.randn(experts, 40, 24, generator=gen) * 0.2).to(DEVICE)
    moe.w2_weight.data = (torch.randn(experts, 24, 20, generator=gen) * 0.2).to(DEVICE)
    x = torch.randn(tokens, 24, generator=gen).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    logits[:, -1] -= 100  # the last expert is never chosen
    weights, ids = softmax_topk(logits, top_k, renormalize=True)
    expected = moe(x, weights, ids)
    got = moe_triton.fused_experts(x, moe.w13_weight, moe.w2_weight, weights, ids, block_m=16)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slice_rank", [0, 1])
def test_gpt_oss_experts_on_the_grouped_gemm_match_the_torch_path(monkeypatch, slice_rank):
    """gpt-oss's experts (both biases, clamped SwiGLU) on the GPU path: the grouped GEMM adds each
    expert's bias rows and takes their activation; a rank other than 0 of a tensor-parallel group
    leaves the output bias to rank 0."""
    from pagoda.models.gpt_oss import ClampedSwigluExperts

    gen = torch.Generator().manual_seed(7 + slice_rank)
    moe = ClampedSwigluExperts(5, 24, 20, torch.float32, alpha=1.702, limit=1.5)
    for name, shape in (("w13_weight", (5, 40, 24)), ("w2_weight", (5, 24, 20)), ("w13_bias", (5, 40)),
                        ("w2_bias", (5, 24))):
        getattr(moe, name).data = (torch.randn(*shape, generator=gen) * 0.4).to(DEVICE)
    moe.slice_rank = slice_rank
    x = torch.randn(11, 24, generator=gen).to(DEVICE)
    weights, ids = softmax_topk(torch.randn(11, 5, generator=gen).to(DEVICE), 2, renormalize=True)
    expected = moe._forward_grouped(x, weights, ids)
    assert (moe.w13_weight.float() @ x.T).abs().max() > 1.5  # the clamps really cut some values
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    calls: list[int] = []
    real = moe_triton.fused_experts
    monkeypatch.setattr(moe_triton, "fused_experts", lambda x, *a, **k: calls.append(len(k)) or real(x, *a, **k))
    torch.testing.assert_close(moe(x, weights, ids), expected, rtol=1e-4, atol=1e-4)
    assert calls == [3]  # both biases and the activation went to the kernel


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()


def test_moe_layer_takes_the_triton_path_when_forced(monkeypatch):
    """FusedMoE.forward on the GPU code path (PAGODA_FORCE_TRITON), expert parallel included:
    rank 1 of 2 holds experts 2..3 and contributes only their pairs."""
    from pagoda.distributed import parallel_state as ps

    gen = torch.Generator().manual_seed(5)
    w13 = (torch.randn(4, 16, 8, generator=gen) * 0.3).to(DEVICE)
    w2 = (torch.randn(4, 8, 8, generator=gen) * 0.3).to(DEVICE)
    x = torch.randn(6, 8, generator=gen).to(DEVICE)
    weights, ids = softmax_topk(torch.randn(6, 4, generator=gen).to(DEVICE), 2, renormalize=False)
    full = FusedMoE(4, 8, 8, torch.float32)
    full.w13_weight.data, full.w2_weight.data = w13.clone(), w2.clone()
    monkeypatch.setattr(ps, "_TP", ps.TPGroup(1, 2))
    monkeypatch.setattr(ps, "_EXPERT_PARALLEL", True)
    half = FusedMoE(4, 8, 8, torch.float32)
    half.w13_weight.data, half.w2_weight.data = w13[2:].clone(), w2[2:].clone()
    mine = (ids >= 2).float()
    expected = FusedMoE.forward(full, x, weights * mine, ids)  # torch path, other ranks' pairs zeroed
    torch.testing.assert_close(half(x, weights, ids), expected, rtol=1e-5, atol=1e-5)  # torch EP path
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    torch.testing.assert_close(half(x, weights, ids), expected, rtol=1e-4, atol=1e-4)  # Triton EP path


