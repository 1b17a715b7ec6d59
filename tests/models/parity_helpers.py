"""Checks shared by the architecture parity tests: pagoda's prefill and teacher-forced decode
logprobs, and greedy generations, against Hugging Face transformers on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def check_logprobs(llm: LLM, hf, prompts: list[list[int]], max_tokens: int = 8, atol: float = 2e-4) -> None:
    """Every reported prompt and sample logprob equals transformers' on prompt + sample."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=3, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        sample = out.outputs[0]
        ref = hf_logprobs(hf, prompt + sample.token_ids)
        assert out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            for token, value in entry.items():
                assert value == pytest.approx(ref[i, token].item(), abs=atol), f"prompt position {i + 1}"
        for j, entry in enumerate(sample.logprobs):
            for token, value in entry.items():
                assert value == pytest.approx(ref[len(prompt) - 1 + j, token].item(), abs=atol), f"decode step {j}"


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_greedy(llm: LLM, hf, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    got = greedy(llm, prompts, n)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, n)
    return got


# The first and third run past the 8- and 16-token windows and chunks of the family checkpoints.
LONG_PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 7], list(range(100, 190, 3)), list(range(200, 223))]


def check_engine_paths(model_dir, hf, prompts: list[list[int]] = LONG_PROMPTS, n: int = 20) -> LLM:
    """The whole parity drill of a family: prompt/decode logprobs and greedy tokens against
    transformers, then the same tokens from prefix-cache hits, from chunked prefill over 4-token
    blocks with rounds of four decode steps, and under preemption (room for 30 such blocks, fewer
    than the prompts need together). Returns the plain engine."""
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    check_logprobs(llm, hf, prompts[:3], max_tokens=12)
    full = check_greedy(llm, hf, prompts, n)
    assert greedy(llm, prompts, n) == full  # prefix-cache hits
    chunked = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256, long_prefill_token_threshold=7,
                  block_size=4, num_scheduler_steps=4)
    assert greedy(chunked, prompts, n) == full
    assert greedy(chunked, prompts, n) == full
    m = llm.config.model
    tight = LLM(str(model_dir), kv_cache_memory=30 * 2 * m.num_layers * 4 * m.num_kv_heads * m.head_dim * 4,
                max_model_len=96, block_size=4)
    assert greedy(tight, prompts, n) == full
    assert tight.engine.core.scheduler.num_preemptions > 0
    return llm
