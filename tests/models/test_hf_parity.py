"""pagoda against Hugging Face transformers on the same random checkpoints: prefill logits,
teacher-forced decode logits and greedy generations."""
from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), [300, 301, 302], list(range(100, 190, 3))]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    hf = _hf(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=5, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        sample = out.outputs[0]
        full = prompt + sample.token_ids
        ref = _hf_logprobs(hf, full)
        # Prefill: position i predicts prompt token i+1.
        assert out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            for token, value in entry.items():
                assert value == pytest.approx(ref[i, token].item(), abs=2e-4)
        # Decode (teacher-forced on the generated tokens): position len(prompt)-1+j predicts token j.
        for j, entry in enumerate(sample.logprobs):
            for token, value in entry.items():
                assert value == pytest.approx(ref[len(prompt) - 1 + j, token].item(), abs=2e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    hf = _hf(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              min_new_tokens=40)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


def test_text_prompt_and_chat(llama_llm, llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    out = llama_llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("Hello there")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    chat = llama_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4),
                          use_tqdm=False)[0]
    expected = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.prompt == expected
    assert chat.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
