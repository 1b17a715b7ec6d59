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


@pytest.mark.parametrize("arch", ["deepseek_v3"])
def test_two_ranks_match_one(model_factory, arch):
    model_dir = model_factory(arch)
    want, got = _run(model_dir, 1), _run(model_dir, 2)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for wl, gl in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            for token, value in wl.items():
                assert gl[token] == pytest.approx(value, abs=1e-4)
