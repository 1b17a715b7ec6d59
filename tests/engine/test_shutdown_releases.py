"""``LLM.shutdown()`` gives the engine's memory back while the ``LLM`` object still lives: a
second engine built in the same function (the usual loop that rebinds ``llm``) never finds the
first one's weights and cache still allocated (on a GPU its memory profile would count them as
its own and size a cache below zero)."""
from __future__ import annotations

import weakref

import pytest

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_shutdown_drops_weights_and_cache_before_the_object_goes(model_factory, async_scheduling):
    llm = LLM(str(model_factory("llama")), kv_cache_memory=8 << 20, max_model_len=128,
              async_scheduling=async_scheduling)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.core.executor
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_cache)
    llm.shutdown()
    assert model() is None and cache() is None  # ``llm`` is still bound here
    llm.shutdown()  # idempotent
    again = LLM(str(model_factory("llama")), kv_cache_memory=8 << 20, max_model_len=128)
    try:
        assert again.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY,
                              use_tqdm=False)[0].outputs[0].token_ids == first
    finally:
        again.shutdown()
