"""The dense families under tensor parallelism (gloo, CPU): Gemma 2 (sandwich norms, soft-capped
attention, alternating windows), Phi-3 (fused q/k/v and gate/up checkpoint tensors) and OLMo 2
(q/k norms over every head, their squares summed across ranks; on four ranks its two K/V heads
are each held twice), gpt-oss (each rank's attention sinks, expert slices with the down bias
added once) and Llama 4 (stacked expert slices, the shared expert) give transformers' greedy
tokens; so does Gemma 2 over two pipeline stages."""
from __future__ import annotations

import pytest

from pagoda import LLM
from tests.models.parity_helpers import check_greedy, hf_model

PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 7], list(range(200, 223))]


@pytest.mark.parametrize("family, ranks", [("gemma2", 2), ("phi3", 2), ("olmo2", 2), ("olmo2", 4), ("gpt_oss", 2),
                                           ("llama4", 2)])
def test_ranks_match_transformers(model_factory, family, ranks):
    model_dir = model_factory(family)
    llm = LLM(str(model_dir), tensor_parallel_size=ranks, kv_cache_memory=4 << 20, max_model_len=128)
    try:
        check_greedy(llm, hf_model(model_dir), PROMPTS, 12)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_expert_parallel_matches_transformers(model_factory, family):
    """Whole experts per rank (two of four each), read from the stacked checkpoint tensors; the
    gpt-oss down bias added by the expert's owner, Llama 4's shared expert still sliced."""
    model_dir = model_factory(family)
    llm = LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory=4 << 20,
              max_model_len=128)
    try:
        check_greedy(llm, hf_model(model_dir), PROMPTS, 12)
    finally:
        llm.shutdown()


def test_gemma2_pipeline_stages_match_transformers(model_factory):
    """Two pipeline stages: the scaled embedding on the first, the tied LM head and the final
    soft-cap on the second."""
    model_dir = model_factory("gemma2")
    llm = LLM(str(model_dir), pipeline_parallel_size=2, kv_cache_memory=4 << 20, max_model_len=128)
    try:
        check_greedy(llm, hf_model(model_dir), PROMPTS, 12)
    finally:
        llm.shutdown()
