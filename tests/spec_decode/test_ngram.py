"""N-gram (prompt lookup) speculation: proposals, and greedy outputs identical to ordinary
decoding under prefix caching, chunked prefill and preemption."""
from __future__ import annotations

import pytest
from spec_helpers import assert_no_leak, copy_prompts, generate, random_prompts

from pagoda import LLM, SamplingParams
from pagoda.spec_decode.ngram import NgramIndex

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# 2 layers x (K, V) x 2 kv heads x 128 dims x 4 bytes = 4 KiB per token: 16 blocks of 16 tokens.
TIGHT_KV = 16 * 16 * 4096


def _lookup(tokens: list[int], k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    index = NgramIndex(n_min, n_max)
    index.update(tokens)
    return index.lookup(tokens, k)


def test_lookup_prefers_the_longest_suffix_then_the_latest_occurrence() -> None:
    assert _lookup([9, 1, 2, 7, 3, 1, 2, 8, 9, 1, 2], 3) == [7, 3, 1]  # "9 1 2" beats the later "1 2"
    assert _lookup([1, 2, 5, 1, 2, 6, 1, 2], 3) == [6, 1, 2]  # the latest "1 2"
    assert _lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert _lookup([5, 6, 5, 6], 4) == [5, 6]  # only what exists after the match
    assert _lookup([5, 6, 5, 6], 4, n_min=3) == []


def test_lookup_index_grows_with_the_sequence() -> None:
    index = NgramIndex(1, 2)
    tokens = [4, 5, 6]
    index.update(tokens)
    assert index.lookup(tokens, 2) == []
    tokens += [4, 5]
    index.update(tokens)
    assert index.lookup(tokens, 2) == [6, 4]


def test_greedy_identical_with_prefix_cache_chunking_and_preemption(copy_model_dir) -> None:
    prompts = copy_prompts(10, seed=1, shared=20)
    base = LLM(str(copy_model_dir), kv_cache_memory=TIGHT_KV, max_model_len=256, max_num_batched_tokens=32)
    expected = generate(base, prompts, GREEDY)
    spec = LLM(str(copy_model_dir), kv_cache_memory=TIGHT_KV, max_model_len=256, max_num_batched_tokens=32,
               speculative_config=NGRAM)
    assert generate(spec, prompts, GREEDY) == expected
    core = spec.engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.kv.stats.hits > 0
    stats = core.stats()
    assert stats.spec_proposed > 0 and stats.spec_accepted / stats.spec_proposed > 0.8
    assert_no_leak(spec)


def test_greedy_identical_when_drafts_are_mostly_wrong(llama_dir) -> None:
    prompts = random_prompts(8, seed=2)
    base = LLM(str(llama_dir), kv_cache_memory=8 << 20)
    spec = LLM(str(llama_dir), kv_cache_memory=8 << 20, speculative_config=NGRAM)
    params = GREEDY.clone(max_tokens=60)
    assert generate(spec, prompts, params) == generate(base, prompts, params)
    assert spec.engine.core.proposer.num_proposed > spec.engine.core.proposer.num_accepted
    assert_no_leak(spec)


def test_penalties_stops_and_logprobs_match_ordinary_decoding(copy_model_dir) -> None:
    prompts = copy_prompts(4, seed=3)
    stop = prompts[1]["prompt_token_ids"][5]
    params = [SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=7)]
    base = LLM(str(copy_model_dir), kv_cache_memory=8 << 20).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(str(copy_model_dir), kv_cache_memory=8 << 20, speculative_config=NGRAM)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(base, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert spec[1].outputs[0].stop_reason == stop and len(spec[1].outputs[0].token_ids) < 30
    lp_a, lp_b = base[0].outputs[0].logprobs, spec[0].outputs[0].logprobs
    assert len(lp_b) == len(spec[0].outputs[0].token_ids)
    for x, y in zip(lp_a, lp_b):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)
    assert abs(base[0].outputs[0].cumulative_logprob - spec[0].outputs[0].cumulative_logprob) < 1e-2
    m = spec[3].metrics
    assert m.spec_proposed_tokens > 0 and m.spec_accepted_tokens > 0 and m.spec_emitted_tokens > 0
    assert m.spec_acceptance_rate is not None and m.spec_mean_accepted_length > 1


def test_disable_by_batch_size(copy_model_dir) -> None:
    prompts = copy_prompts(6, seed=4)
    llm = LLM(str(copy_model_dir), kv_cache_memory=8 << 20,
              speculative_config={**NGRAM, "disable_by_batch_size": 3})
    proposer = llm.engine.core.proposer
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    generate(llm, prompts, params)  # six requests: the batch exceeds 3 from the start, no proposals
    assert proposer.num_proposed == 0
    generate(llm, prompts[:3], params)
    assert proposer.num_proposed > 0
    # With at most 2 sequences per step the batch never exceeds the limit, however many wait.
    capped = LLM(str(copy_model_dir), kv_cache_memory=8 << 20, max_num_seqs=2,
                 speculative_config={**NGRAM, "disable_by_batch_size": 3})
    generate(capped, prompts, params)
    assert capped.engine.core.proposer.num_proposed > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_forked_samples_speculate_with_logprobs(copy_model_dir, method: str) -> None:
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = str(copy_model_dir)
    llm = LLM(str(copy_model_dir), kv_cache_memory=8 << 20, speculative_config=config)
    params = SamplingParams(n=3, temperature=0.5, seed=1, max_tokens=30, ignore_eos=True, logprobs=1)
    outs = llm.generate(copy_prompts(3, seed=5), params, use_tqdm=False)
    for out in outs:
        assert [len(c.token_ids) for c in out.outputs] == [30, 30, 30]
        assert all(len(c.logprobs) == 30 and c.token_ids[-1] in c.logprobs[-1] for c in out.outputs)
    assert llm.engine.core.proposer.num_accepted > 0
    assert_no_leak(llm)
