"""Sleep mode in one process (EngineCore.sleep / wake_up / update_weights, ModelRunner): memory
given back, greedy outputs identical after waking, a new checkpoint's outputs after an update,
and requests caught mid-flight finishing as if nothing happened."""
from __future__ import annotations

import gc

import psutil
import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [100, 101, 102, 103, 104, 105, 106], [300, 200, 100]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KV_BYTES = 96 << 20
# Big enough that its weights are a measurable part of the process (~70 MiB of float32).
BIG = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024, vocab_size=8192)


def texts(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def big_dirs(model_factory):
    return model_factory("llama", **BIG), model_factory("llama", **BIG, seed=7)


@pytest.fixture(scope="module")
def llm(big_dirs):
    engine = LLM(str(big_dirs[0]), kv_cache_memory=KV_BYTES, max_model_len=256, enable_sleep_mode=True)
    yield engine
    engine.shutdown()


def test_sleep_level_1_gives_back_the_kv_cache_and_wakes_with_identical_outputs(llm):
    core = llm.engine.core
    before = texts(llm)
    # The host cache's pages are resident once touched (``transfer.zeros``): touch them all, as
    # a cache in full use holds them, values unchanged.
    core.executor.kv_cache.add_(0)
    held = rss()
    freed = core.sleep(1)
    assert freed >= KV_BYTES * 0.95 and core.sleeping == 1 and core.executor.kv_cache is None
    returned = held - rss()
    assert returned >= 0.8 * freed, f"only {returned / 2**20:.1f} of {freed / 2**20:.1f} MiB went back"
    core.wake_up()
    assert core.sleeping == 0 and core.kv.num_free_blocks == core.kv.num_blocks
    assert texts(llm) == before


def test_sleep_level_2_gives_back_the_weights_too(llm):
    core = llm.engine.core
    before = texts(llm)
    params = sum(t.numel() * t.element_size() for t in core.executor.model.state_dict().values())
    core.sleep(1)
    held = rss()
    weights = core.sleep(2)  # the weights alone (and their packed copies): the cache went at level 1
    assert core.executor.model is None and weights >= params
    returned = held - rss()
    print(f"level 2: {returned / 2**20:.1f} MiB returned of {weights / 2**20:.1f} MiB of weights")
    assert returned >= 0.8 * weights
    core.wake_up()
    assert texts(llm) == before


def test_requests_in_flight_at_sleep_finish_unchanged(llm):
    # Long enough that two steps cannot finish them, whatever multi-step rounds the engine runs.
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                              use_tqdm=False)]
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.step()
    assert engine.has_unfinished_requests()  # in flight when the engine goes to sleep
    engine.core.sleep(2)
    assert not engine.has_unfinished_requests()  # asleep: nothing to step on, the requests wait
    engine.core.wake_up()
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == expected


def test_update_weights_serves_the_new_checkpoint_and_refuses_other_shapes(llm, big_dirs, model_factory):
    first, second = big_dirs
    before = texts(llm)
    core = llm.engine.core
    with pytest.raises(ValueError, match="same architecture and shapes"):
        core.update_weights(str(model_factory("llama")))  # the small test model
    assert texts(llm) == before  # a refused update changes nothing
    core.update_weights(str(second))
    updated = texts(llm)
    fresh = LLM(str(second), kv_cache_memory=KV_BYTES, max_model_len=256)
    try:
        assert updated == texts(fresh) != before
    finally:
        fresh.shutdown()
    core.sleep(1)
    with pytest.raises(ValueError, match="asleep"):
        core.update_weights(str(first))
    core.wake_up()
    core.update_weights(str(first))
    assert texts(llm) == before


def test_sleep_mode_is_refused_where_it_does_not_apply(llama_llm, llama_dir):
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llama_llm.engine.core.sleep(1)
    with pytest.raises(ValueError, match="enable_sleep_mode supports one process"):
        LLM(str(llama_dir), enable_sleep_mode=True, speculative_config={"method": "ngram",
                                                                      "num_speculative_tokens": 2})
