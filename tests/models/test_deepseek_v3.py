"""DeepSeek-V3 (MLA + grouped-top-k experts) against transformers, its latent KV cache and
its behaviour under the scheduler's features."""
from __future__ import annotations

import pytest

from pagoda import LLM
from tests.models.parity_helpers import check_greedy, check_logprobs, greedy, hf_model

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), [300, 301, 302], list(range(100, 190, 3))]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
VARIANTS = {
    "q_lora": {},
    # No q compression, plain rotate-half rope, unnormalised weights, one expert group, YaRN.
    "no_q_lora_yarn": dict(rope_scaling=YARN, extra_config=dict(
        n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=20,
        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=28, qk_nope_head_dim=8,
        qk_rope_head_dim=12, v_head_dim=8, routed_scaling_factor=1.5, norm_topk_prob=False,
        rope_interleave=False, attention_bias=True)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deepseek_v3_matches_transformers(model_factory, variant):
    model_dir = model_factory("deepseek_v3", **VARIANTS[variant])
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    check_logprobs(llm, hf, PROMPTS)
    check_greedy(llm, hf, PROMPTS, 12)


def test_latent_kv_cache_bytes_per_token(model_factory):
    llm = LLM(str(model_factory("deepseek_v3")), kv_cache_memory=8 << 20, max_model_len=256)
    executor = llm.engine.core.executor
    per_token = executor.kv_bytes_per_block() // llm.config.cache.block_size
    assert per_token == 3 * (24 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x fp32


def test_scheduler_features_leave_outputs_unchanged(model_factory):
    model_dir = str(model_factory("deepseek_v3"))
    shared = list(range(40, 80))
    prompts = [shared + [7, 8, 9], shared + [300, 5], list(range(200, 250)), [11, 12, 13]]
    base = greedy(LLM(model_dir, kv_cache_memory=8 << 20, max_model_len=256, enable_prefix_caching=False,
                      enable_chunked_prefill=False), prompts, 12)
    # Prefix caching, chunked prefill and a cache of 12 blocks of 8 tokens (three layers of
    # 32 fp32 latent values per token), too small for all four sequences: preemption happens.
    tight = LLM(model_dir, kv_cache_memory=12 * 8 * 3 * 32 * 4, max_model_len=64, block_size=8,
                long_prefill_token_threshold=9)
    assert greedy(tight, prompts, 12) == base
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert greedy(tight, prompts[:2], 12) == base[:2]  # again, from the prefix cache
    assert tight.engine.core.kv.stats.hits > 0
    ngram = LLM(model_dir, kv_cache_memory=8 << 20, max_model_len=256,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert greedy(ngram, prompts, 12) == base
