"""The encoder budget per step on a random-weight Qwen2.5-VL (float32, CPU): a prompt with
several images gives the same tokens and logprobs under a budget that lets one image through
per step as under the default, and while its images are encoded one step at a time a text
request decodes in every one of those steps."""
from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.multimodal.processor import image_placeholder
from pagoda.tools.make_vlm import make_vlm
from vlm_helpers import greedy_params, image, run, sampled_logprobs

N = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vlm(tmp_path_factory.mktemp("qwen2_5_vl"), arch="qwen2_5_vl")


def _llm(checkpoint, **kwargs) -> LLM:
    return LLM(str(checkpoint), dtype="float32", kv_cache_memory=32 << 20, **kwargs)


def _prompts(llm: LLM, seed: int = 21) -> list[dict]:
    ph = image_placeholder(llm.config.model)
    imgs = [image(seed, 56, 84), image(seed + 1, 84, 56), image(seed + 2, 56, 56)]
    return [{"prompt": f"compare {ph} with {ph} and {ph}, please", "multi_modal_data": {"image": imgs}},
            {"prompt": f"and this one {ph}?", "multi_modal_data": {"image": imgs[2]}},
            {"prompt": "a text-only question about trees"}]


def test_tiny_budget_same_outputs_and_decodes_keep_running(checkpoint):
    default = _llm(checkpoint)
    try:
        assert default.config.scheduler.max_num_encoder_tokens_per_step == \
            default.config.scheduler.max_num_batched_tokens
        prompts = _prompts(default)
        expected = run(default, prompts, N)
    finally:
        default.shutdown()
    tiny = _llm(checkpoint, max_num_encoder_tokens_per_step=1)  # every image alone in its step
    try:
        got = run(tiny, prompts, N)
        for e, g in zip(expected, got):
            assert g.prompt_token_ids == e.prompt_token_ids
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            assert sampled_logprobs(g) == pytest.approx(sampled_logprobs(e), abs=1e-5)
        _decode_beside_encoding(tiny, _prompts(tiny, seed=31)[0])
    finally:
        tiny.shutdown()


def _decode_beside_encoding(llm: LLM, image_prompt: dict) -> None:
    """A text request decoding when a prompt with three new images arrives: each step encodes
    at most one image, and each such step gives the text request a token."""
    engine = llm.engine
    mm = engine.core.executor.mm
    engine.add_request("text", {"prompt": "tell me a long story about trees"},
                       greedy_params(64))
    tokens = {"text": 0}
    while tokens["text"] < 2:
        tokens.update((o.request_id, len(o.outputs[0].token_ids)) for o in engine.step())
    engine.add_request("image", image_prompt, greedy_params(2))
    encoded_steps = 0
    while engine.has_unfinished_requests():
        before, text_before = mm.num_encoded, tokens["text"]
        tokens.update((o.request_id, len(o.outputs[0].token_ids)) for o in engine.step())
        new = mm.num_encoded - before
        assert new <= 1
        if new:
            encoded_steps += 1
            assert tokens["text"] > text_before  # the text request decoded in this step
        if tokens.get("image", 0) == 2:
            engine.abort_request("text")
            break
    assert encoded_steps == 3


def test_budget_must_be_a_positive_integer(checkpoint):
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="max_num_encoder_tokens_per_step"):
            _llm(checkpoint, max_num_encoder_tokens_per_step=bad)
