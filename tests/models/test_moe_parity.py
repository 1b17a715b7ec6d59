"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its gated shared expert and a dense
layer, Qwen3-MoE with decoder_sparse_step) against transformers: prefill and teacher-forced
decode logprobs, and greedy generations for a batch of prompts of different lengths."""
from __future__ import annotations

import pytest
import torch

from pagoda import LLM
from pagoda.layers.moe import FusedMoE, softmax_topk
from tests.models.parity_helpers import check_greedy, check_logprobs, hf_model

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), [300, 301, 302], list(range(100, 190, 3))]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_matches_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    check_logprobs(llm, hf, PROMPTS)
    check_greedy(llm, hf, PROMPTS, 12)


def test_grouped_experts_match_a_per_token_loop():
    """The sorted, grouped computation equals computing every (token, expert) pair alone."""
    gen = torch.Generator().manual_seed(0)
    moe = FusedMoE(7, 16, 12, torch.float32)
    moe.w13_weight.data = torch.randn(7, 24, 16, generator=gen)
    moe.w2_weight.data = torch.randn(7, 16, 12, generator=gen)
    x = torch.randn(9, 16, generator=gen)
    weights, ids = softmax_topk(torch.randn(9, 7, generator=gen), 3, renormalize=False)
    expected = torch.zeros(9, 16)
    for t in range(9):
        for j in range(3):
            e = int(ids[t, j])
            h = x[t] @ moe.w13_weight[e].T
            act = torch.nn.functional.silu(h[:12]) * h[12:]
            expected[t] += weights[t, j] * (act @ moe.w2_weight[e].T)
    torch.testing.assert_close(moe(x, weights, ids), expected, rtol=1e-5, atol=1e-5)
    assert moe.pack_weight() or True  # packing is optional (oneDNN); the result must not change
    torch.testing.assert_close(moe(x, weights, ids), expected, rtol=1e-5, atol=1e-5)


def test_one_token_equals_its_row_in_a_batch():
    """Batch-1 decode takes a shortcut (no sort); a token's output must not depend on it."""
    gen = torch.Generator().manual_seed(1)
    moe = FusedMoE(6, 32, 16, torch.float32)
    moe.w13_weight.data = torch.randn(6, 32, 32, generator=gen)
    moe.w2_weight.data = torch.randn(6, 32, 16, generator=gen)
    moe.pack_weight()
    x = torch.randn(7, 32, generator=gen)
    weights, ids = softmax_topk(torch.randn(7, 6, generator=gen), 3, renormalize=True)
    batched = moe(x, weights, ids)
    for t in range(7):
        assert torch.equal(moe(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), batched[t:t + 1])
