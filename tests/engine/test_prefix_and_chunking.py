"""Prefix caching and chunked prefill never change outputs (greedy or seeded sampling)."""
from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

BS = 16


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def engines(llama_dir):
    on = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=1024)
    off = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=1024, enable_prefix_caching=False)
    return on, off


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_cache_on_equals_off_for_shared_prefixes(engines, params):
    on, off = engines
    rng = random.Random(0)
    system = ids(rng, 3 * BS)  # ends exactly at a block boundary
    odd = ids(rng, 2 * BS + 5)  # ends mid-block
    prompts = [system + ids(rng, 7), system + ids(rng, 20), odd + ids(rng, 3), odd + ids(rng, 9), list(system)]
    on.reset_prefix_cache()
    warm, _ = run(on, [prompts[0], prompts[2]], params)
    got, outs = run(on, prompts, params)  # the rest hit what the warm-up cached
    want, _ = run(off, prompts, params)
    assert got == want and warm == [want[0], want[2]]
    assert outs[1].num_cached_tokens == 3 * BS
    assert outs[3].num_cached_tokens == 2 * BS
    # A fully cached prompt still computes its last block, so there are logits to sample from.
    assert outs[4].num_cached_tokens == 2 * BS
    stats = on.engine.core.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    assert stats.prefix_cache_blocks >= 3  # the system prompt's three blocks at least


def test_multi_turn_conversation_hits_generated_blocks(engines):
    on, off = engines
    on.reset_prefix_cache()
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    history = ids(rng, 40)
    for turn in range(3):
        got, outs = run(on, [history], params)
        want, _ = run(off, [history], params)
        assert got == want
        if turn:
            # The previous turn's prompt and answer (whole blocks) are reused.
            assert outs[0].num_cached_tokens >= (len(history) - 24 - 10) // BS * BS - BS
        history = history + got[0] + ids(rng, 10)


def test_hits_after_evictions_and_with_preemption(llama_dir, engines):
    _, off = engines
    # 512 bytes per token: 24 blocks of 16 tokens.
    small = LLM(str(llama_dir), kv_cache_memory=24 * 16 * 512, max_model_len=256)
    rng = random.Random(2)
    prefixes = [ids(rng, 2 * BS) for _ in range(6)]
    prompts = [prefixes[i % 6] + ids(rng, 5 + i) for i in range(30)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    got, outs = run(small, prompts, params)
    want, _ = run(off, prompts, params)
    assert got == want
    core = small.engine.core
    assert core.kv.stats.evictions > 0 and core.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert core.kv.num_used_blocks == 0
    core.kv.reset_prefix_cache()
    core.kv.check_invariants([])


def test_lpm_policy_and_lfu_eviction_keep_outputs(llama_dir, engines):
    _, off = engines
    llm = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=1024, scheduling_policy="lpm",
              eviction_policy="lfu")
    rng = random.Random(3)
    shared = ids(rng, 48)
    prompts = [ids(rng, 30), shared + ids(rng, 4), ids(rng, 20), shared + ids(rng, 8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert run(llm, prompts, params)[0] == run(off, prompts, params)[0]


@pytest.mark.parametrize("budget", [1, 7, 16, 64])
def test_chunk_budgets_leave_outputs_and_logits_unchanged(llama_dir, budget):
    rng = random.Random(4)
    prompts = [ids(rng, n) for n in (5, 37, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    ref = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=512, enable_chunked_prefill=False)
    chunked = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=512, max_num_batched_tokens=budget)
    _, want = run(ref, prompts, params)
    _, got = run(chunked, prompts, params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[k] - y[k]) < 1e-4 for k in x)


def test_chunking_with_prefix_hits(llama_dir, engines):
    _, off = engines
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=512, max_num_batched_tokens=7)
    rng = random.Random(5)
    base = ids(rng, 50)
    prompts = [base + ids(rng, 13), base + ids(rng, 29)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    run(llm, prompts[:1], params)
    got, outs = run(llm, prompts, params)
    assert got == run(off, prompts, params)[0]
    assert outs[1].num_cached_tokens == 48


def test_prompt_over_budget_without_chunking_is_refused(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=512, enable_chunked_prefill=False,
              max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens 32"):
        llm.generate([{"prompt_token_ids": [5] * 40}], use_tqdm=False)
    assert len(llm.generate([{"prompt_token_ids": [5] * 30}], use_tqdm=False)) == 1
