"""Offline ``LLM.generate(..., priority=[...])`` under the priority policy (vLLM's argument)."""
from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams


def test_generate_runs_lower_priorities_first(llama_dir, llama_llm):
    llm = LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1, kv_cache_memory=16 << 20,
              max_model_len=256)
    try:
        prompts = [{"prompt_token_ids": [5 + i] * 6} for i in range(3)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False,
                            priority=[5, 0, 2])
        started = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
        assert started == [1, 2, 0]
        with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
            llm.generate(prompts, use_tqdm=False, priority=[0, 1])  # one per prompt
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="scheduling_policy"):
        llama_llm.generate([{"prompt_token_ids": [5, 6]}], use_tqdm=False, priority=[1])
