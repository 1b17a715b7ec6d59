"""The dense families under tensor parallelism (gloo, CPU): Gemma 2 (sandwich norms, soft-capped
attention, alternating windows) and Phi-3 (fused q/k/v and gate/up checkpoint tensors) give
transformers' greedy tokens on two ranks; OLMo 2, whose q/k norms span every head, is refused
before any process starts."""
from __future__ import annotations

import pytest
from tp_helpers import child_pids

from pagoda import LLM
from tests.models.parity_helpers import check_greedy, hf_model

PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 7], list(range(200, 223))]


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_two_ranks_match_transformers(model_factory, family):
    model_dir = model_factory(family)
    llm = LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20, max_model_len=128)
    try:
        check_greedy(llm, hf_model(model_dir), PROMPTS, 12)
    finally:
        llm.shutdown()


def test_olmo2_is_refused_before_any_process_starts(model_factory):
    path = model_factory("olmo2")
    before = child_pids()
    with pytest.raises(ValueError, match="Olmo2ForCausalLM does not run with tensor_parallel_size 2"):
        LLM(str(path), tensor_parallel_size=2, kv_cache_memory=1 << 20, max_model_len=64)
    assert child_pids() == before
