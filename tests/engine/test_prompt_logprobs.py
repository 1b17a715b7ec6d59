"""``prompt_logprobs`` against transformers' log-softmax over the prompt (float32, within 1e-4):
position by position the prompt token's logprob and the top k, the first position None; with a
warm prefix cache (such a request computes its whole prompt, as vLLM's skip of cache hits does),
with chunked prefill (positions collected across chunks) and beside other rows of the batch."""
from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams

VOCAB = 512  # conftest's llama spec
TOL = 1e-4
K = 5


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _prompts(n: int, seed: int, lo: int, hi: int, shared: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_matches_transformers(hf, prompt: list[int], out, k: int = K) -> None:
    """vLLM's shape: None first, then per position the next prompt token's logprob and the top k
    (k + 1 entries when the prompt token is not among them), each equal to transformers'; and
    the prompt token's rank (1 + the tokens more likely, when no other is within rounding)."""
    ref = _reference(hf, prompt)
    got, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert len(got) == len(prompt) == len(ranks) and got[0] is None and ranks[0] is None
    for pos, entry in enumerate(got[1:]):
        token = prompt[pos + 1]
        near = (ref[pos] - ref[pos, token]).abs() <= TOL
        above = int((ref[pos] > ref[pos, token] + TOL).sum())
        assert above + 1 <= ranks[pos + 1] <= above + int(near.sum())
        assert token in entry and len(entry) in (k, k + 1) if k else list(entry) == [token]
        for t, value in entry.items():
            assert abs(value - ref[pos, t].item()) <= TOL, (pos, t, value, ref[pos, t].item())
        # The k likeliest (compared by value: a near-tie may order two ids either way).
        best = sorted(entry.values(), reverse=True)[:k]
        assert torch.allclose(torch.tensor(best), ref[pos].topk(k).values, rtol=0, atol=TOL)


def test_prompt_logprobs_equal_transformers(hf, llama_llm) -> None:
    prompts = _prompts(4, seed=1, lo=2, hi=60)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)
    outs = llama_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out)


def test_k_zero_gives_the_prompt_tokens_alone(hf, llama_llm) -> None:
    prompt = _prompts(1, seed=2, lo=20, hi=20)[0]
    out = llama_llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)[0]
    ref = _reference(hf, prompt)
    assert out.prompt_logprobs[0] is None
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert list(entry) == [prompt[pos + 1]]
        assert abs(entry[prompt[pos + 1]] - ref[pos, prompt[pos + 1]].item()) <= TOL


def test_warm_prefix_cache_still_gives_every_position(hf, llama_dir) -> None:
    llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=512)
    shared = _prompts(1, seed=3, lo=64, hi=64)[0]
    prompts = _prompts(3, seed=4, lo=5, hi=20, shared=shared)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    warm = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    feed = [{"prompt_token_ids": p} for p in prompts]
    # Mixed with cache-hitting requests that do not ask: they keep their hits and their tokens.
    outs = llm.generate(feed + feed, [params] * 3 + [plain] * 3, use_tqdm=False)
    for prompt, out, before in zip(prompts, outs[:3], warm):
        assert out.num_cached_tokens == 0  # the whole prompt was computed, so every position has logits
        assert_matches_transformers(hf, prompt, out)
        assert out.outputs[0].token_ids == before.outputs[0].token_ids
    for out, before in zip(outs[3:], warm):
        assert out.num_cached_tokens >= 64 and out.prompt_logprobs is None
        assert out.outputs[0].token_ids == before.outputs[0].token_ids
    llm.shutdown()


def test_chunked_prefill_collects_every_chunk(hf, llama_dir) -> None:
    llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=512, max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    prompts = _prompts(3, seed=5, lo=40, hi=90)
    chunks: list[int] = []
    execute = llm.engine.core.executor.execute

    def record(sched):
        chunks.extend(item.num_new_tokens for item in sched.scheduled)
        return execute(sched)

    llm.engine.core.executor.execute = record
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(chunks) <= 16 and sum(len(p) for p in prompts) > 16 * 3  # prompts ran in several chunks
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out)
    llm.shutdown()
