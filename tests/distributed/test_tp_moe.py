"""Tensor parallelism on the mixture-of-experts and MLA models: two ranks (gloo, CPU), each
holding every expert's half of the intermediate dimension and half the attention heads (MLA:
the latent cache replicated), give the single-rank greedy tokens and logprobs."""
from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), list(range(100, 190, 3))]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _run(model_dir, tp: int):
    llm = LLM(str(model_dir), tensor_parallel_size=tp, kv_cache_memory=4 << 20, max_model_len=128)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_rank(model_factory):
    return _run(model_factory("deepseek_v3"), 1)


def test_two_ranks_match_one(model_factory, one_rank):
    want, got = one_rank, _run(model_factory("deepseek_v3"), 2)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for wl, gl in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            for token, value in wl.items():
                assert gl[token] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_expert_parallel_matches_one_rank(model_factory, one_rank, arch):
    """--enable-expert-parallel with two ranks: rank 0 holds the first half of the experts whole
    (Mixtral 5 experts cannot split in two and is refused; DeepSeek's 8 split 4 + 4)."""
    model_dir = model_factory(arch)
    if arch == "mixtral":
        with pytest.raises(ValueError, match="does not divide the model's 5 experts"):
            LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True)
        return
    want = one_rank
    llm = LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory=4 << 20,
              max_model_len=128)
    try:
        experts = llm.engine.core.executor.runner.model.model.layers[1].mlp.experts
        assert (experts.num_experts, experts.first_expert, experts.intermediate) == (4, 0, 24)
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for wl, gl in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            for token, value in wl.items():
                assert gl[token] == pytest.approx(value, abs=1e-4)


def test_expert_parallel_refuses_dense_models(model_factory):
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(model_factory("llama")), tensor_parallel_size=2, enable_expert_parallel=True)


def test_expert_sizes_that_do_not_split_are_refused(model_factory):
    """Qwen2-MoE's experts have intermediate 24 and its shared expert 56: neither splits in 5."""
    model_dir = model_factory("qwen2_moe", num_heads=5, num_kv_heads=5, hidden_size=80)
    with pytest.raises(ValueError, match="does not divide the model's (shared_expert|moe)_intermediate_size"):
        LLM(str(model_dir), tensor_parallel_size=5)
