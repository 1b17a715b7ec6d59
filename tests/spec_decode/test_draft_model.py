"""Draft-model speculation: greedy outputs identical to ordinary decoding whether the draft
agrees with the target (itself) or not (another random model), under prefix caching, chunked
prefill and preemption; the draft's own cache stays consistent and is given back."""
from __future__ import annotations

import pytest
from spec_helpers import assert_no_leak, generate, random_prompts

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# llama test model: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes per token.
TIGHT = dict(kv_cache_memory=16 * 16 * 512, max_model_len=256, max_num_batched_tokens=48)


def _spec(model: str, draft: str, **kwargs) -> LLM:
    return LLM(model, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
               **kwargs)


def _prompts() -> list[dict]:
    shared = random_prompts(1, seed=10, lo=40, hi=40)[0]["prompt_token_ids"]
    return [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in random_prompts(10, seed=11, lo=4, hi=30)]


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    return generate(LLM(str(llama_dir), **TIGHT), _prompts(), GREEDY)


def _check(llm: LLM, expected: list[list[int]]) -> float:
    assert generate(llm, _prompts(), GREEDY) == expected
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.kv.stats.hits > 0
    proposer = core.proposer
    assert proposer.states == {} and proposer.kv.num_used_blocks == 0  # draft blocks given back
    assert_no_leak(llm)
    return proposer.acceptance_rate


def test_target_as_its_own_draft_accepts_nearly_everything(llama_dir, expected) -> None:
    llm = _spec(str(llama_dir), str(llama_dir), **TIGHT)
    assert _check(llm, expected) > 0.95


def test_unrelated_draft_is_mostly_rejected_and_changes_nothing(llama_dir, model_factory, expected) -> None:
    other = model_factory("llama", seed=99)
    llm = _spec(str(llama_dir), str(other), **TIGHT)
    assert _check(llm, expected) < 0.5


def test_truncated_target_as_draft(llama_dir, tmp_path, expected) -> None:
    from pagoda.bench.spec import truncate_layers

    draft = truncate_layers(llama_dir, tmp_path / "draft", 1)
    llm = _spec(str(llama_dir), str(draft), **TIGHT)
    _check(llm, expected)


def test_draft_cache_follows_rollbacks_and_aborts(llama_dir, model_factory) -> None:
    """Interleave steps, aborts and new arrivals; after every step each draft state holds a
    prefix of its sequence's tokens followed only by unverified drafts."""
    other = model_factory("llama", seed=99)
    llm = _spec(str(llama_dir), str(other), kv_cache_memory=8 << 20)
    engine, proposer = llm.engine, llm.engine.core.proposer
    for i, p in enumerate(random_prompts(6, seed=12)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True))
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step == 5:
            engine.abort_request("2")
        for state in proposer.states.values():
            assert state.tokens[:state.num_real] == state.seq.token_ids[:state.num_real]
            assert len(state.block_table) == proposer.kv.blocks_for(len(state.tokens))
    assert not engine.has_unfinished_requests() and proposer.states == {}
    proposer.kv.check_invariants([])
