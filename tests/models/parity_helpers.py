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
