"""Fair shares between tenants and cache salts never change outputs (offline engine, tiny model)."""
from __future__ import annotations

import random

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def test_greedy_outputs_are_unchanged_by_fair_shares_and_salts(llama_dir, llama_llm):
    rng = random.Random(11)
    shared = [rng.randrange(10, 500) for _ in range(32)]  # two full blocks every prompt starts with
    prompts = [shared + [rng.randrange(10, 500) for _ in range(rng.randint(3, 40))] for _ in range(10)]
    expected = [o.outputs[0].token_ids for o in
                llama_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    # Six slots and 20 blocks of 16 tokens for ten requests (one with n=4) of three tenants: the
    # fair path preempts and recomputes; salts split the shared prefix between namespaces.
    tight = LLM(str(llama_dir), kv_cache_memory=20 * 16 * 512, max_model_len=256, max_num_seqs=6)
    engine = tight.engine
    try:
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=4 if i == 0 else 1)
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params, tenant=("a", "b", "c")[i % 3],
                               cache_salt=None if i % 2 else f"salt{i % 4}")
        assert engine.core.stats().tenant_requests == {"a": 4, "b": 3, "c": 3}
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
        assert [done[f"r{i}"][0] for i in range(10)] == expected
        assert done["r0"] == [expected[0]] * 4  # greedy samples agree
        assert engine.core.scheduler.num_preemptions > 0
        assert engine.core.kv.num_used_blocks == 0 and not engine.core.scheduler.tenant_requests
    finally:
        tight.shutdown()


def test_offline_cache_salt_in_the_prompt(llama_llm):
    llama_llm.reset_prefix_cache()
    prompt = list(range(40, 90))
    outs = llama_llm.generate([{"prompt_token_ids": prompt, "cache_salt": "x"}], GREEDY, use_tqdm=False)
    again = llama_llm.generate([{"prompt_token_ids": prompt, "cache_salt": "x"},
                                {"prompt_token_ids": prompt, "cache_salt": "y"}], GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in again] == [48, 0]
    assert again[0].outputs[0].token_ids == again[1].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_offline_cache_salt_must_be_a_non_empty_string(llama_llm):
    for salt in ("", 7):
        try:
            llama_llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_salt": salt}], GREEDY, use_tqdm=False)
        except ValueError as exc:
            assert "cache_salt" in str(exc)
        else:
            raise AssertionError(f"cache_salt {salt!r} was accepted")
