"""Vision-language models against transformers on random-weight checkpoints (float32, CPU):
greedy tokens and logprobs for one image, several images and a batch mixing text and image
prompts; the prefix cache keyed by image content; chunked prefill through an image; n > 1 and
preemption with images."""
from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import ParamError
from vlm_helpers import ATOL, FAMILIES, check_greedy, image, run, sampled_logprobs

N = 6


def _available(family: str) -> bool:
    import transformers

    return hasattr(transformers, FAMILIES[family])


@pytest.fixture(scope="module", params=[f for f in FAMILIES if _available(f)])
def family(request) -> str:
    return request.param


def test_single_image_matches_transformers(llm, ref):
    from pagoda.multimodal.processor import image_placeholder, is_multimodal

    assert is_multimodal(llm.config.model)
    assert image_placeholder(llm.config.model) in ref.chat_prompt([None])
    img = image(1, 60, 90)
    out = run(llm, [{"prompt": ref.chat_prompt([None, "what is in this picture?"]),
                     "multi_modal_data": {"image": img}}], N)[0]
    expanded = out.prompt_token_ids.count(ref.model.config.image_token_id)
    assert expanded > 1  # the one placeholder became the image's feature count
    check_greedy(ref, out, [img])


def test_several_images_and_token_ids_prompt(llm, ref):
    imgs = [image(2, 64, 64), image(3, 90, 140)]
    prompt = ref.chat_prompt(["compare", None, "with", None, "please"])
    ids = ref.tokenizer.encode(prompt, add_special_tokens=False)
    out = run(llm, [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}], N)[0]
    check_greedy(ref, out, imgs)


def test_mixed_text_and_image_batch(llm, ref):
    imgs = [image(4, 80, 80), image(5, 60, 120), image(6, 100, 70)]
    prompts = [
        {"prompt": ref.chat_prompt(["a text-only question about trees"])},
        {"prompt": ref.chat_prompt([None, "one"]), "multi_modal_data": {"image": imgs[0]}},
        {"prompt": ref.chat_prompt(["two:", None, None]), "multi_modal_data": {"image": imgs[1:]}},
    ]
    outs = run(llm, prompts, N)
    check_greedy(ref, outs[0], [])
    check_greedy(ref, outs[1], imgs[:1])
    check_greedy(ref, outs[2], imgs[1:])


def test_prefix_cache_keys_on_image_content(llm, ref):
    """The image comes first, so every full block past the first holds image tokens: the same
    image again is a hit; another image of the same size (identical token ids) is not."""
    llm.reset_prefix_cache()
    prompt = ref.chat_prompt([None, "describe it"])
    first, second = image(7, 112, 168), image(8, 112, 168)
    a = run(llm, [{"prompt": prompt, "multi_modal_data": {"image": first}}], N)[0]
    again = run(llm, [{"prompt": prompt, "multi_modal_data": {"image": first}}], N)[0]
    other = run(llm, [{"prompt": prompt, "multi_modal_data": {"image": second}}], N)[0]
    assert a.prompt_token_ids == other.prompt_token_ids
    start = a.prompt_token_ids.index(ref.model.config.image_token_id)
    assert again.num_cached_tokens > start  # blocks holding the image's tokens were reused
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert other.num_cached_tokens <= start  # nothing past the text before the image
    check_greedy(ref, other, [second])


def test_chunked_prefill_through_images(checkpoint, ref, llm):
    """A step budget smaller than an image's tokens: chunks start and end inside images."""
    imgs = [image(9, 112, 140), image(10, 84, 84)]
    prompts = [{"prompt": ref.chat_prompt(["look", None, "and", None]), "multi_modal_data": {"image": imgs}},
               {"prompt": ref.chat_prompt([None, "short"]), "multi_modal_data": {"image": imgs[1]}}]
    whole = run(llm, prompts, N)
    chunked = LLM(str(checkpoint), dtype="float32", kv_cache_memory=32 << 20, max_num_batched_tokens=8,
                  max_num_seqs=2, enable_prefix_caching=False)
    try:
        parts = run(chunked, prompts, N)
    finally:
        chunked.shutdown()
    for w, c in zip(whole, parts):
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
        assert sampled_logprobs(c) == pytest.approx(sampled_logprobs(w), abs=ATOL)
    check_greedy(ref, parts[0], imgs)


def test_n_samples_and_preemption(checkpoint, ref):
    """n = 2 forks an image prompt's blocks; a cache too small for every request at once
    preempts (recomputes) some, images and all, with unchanged greedy outputs."""
    imgs = [image(11 + i, 84, 112) for i in range(4)]
    prompts = [{"prompt": ref.chat_prompt([None, f"item {i}"]), "multi_modal_data": {"image": imgs[i]}}
               for i in range(4)]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, block size, KV heads, head size, float32
    engine = LLM(str(checkpoint), dtype="float32", kv_cache_memory=9 * block_bytes, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
        outs = engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out, img in zip(outs, imgs):
        tokens, _ = ref.greedy(out.prompt_token_ids, [img], 24)
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]


def test_bad_image_inputs_are_refused(llm, ref):
    prompt = ref.chat_prompt([None, "x"])
    with pytest.raises(ParamError, match="placeholders"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image(1, 56, 56)] * 2}}, use_tqdm=False)
    with pytest.raises(ParamError, match="PIL"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": b"not an image"}}, use_tqdm=False)
    assert run(llm, [{"prompt": prompt, "multi_modal_data": {"image": image(1, 56, 56)}}], 2)[0].finished


def test_text_only_model_refuses_images(llama_llm):
    from pagoda.multimodal.processor import image_placeholder, is_multimodal

    assert not is_multimodal(llama_llm.config.model) and image_placeholder(llama_llm.config.model) is None
    with pytest.raises(ParamError, match="takes text only"):
        llama_llm.generate({"prompt": "hi", "multi_modal_data": {"image": image(1, 56, 56)}}, use_tqdm=False)


def test_ngram_speculation_with_images(checkpoint, ref, llm):
    """Drafts follow an image prompt's last token at index + delta, as its real tokens do."""
    img = image(20, 84, 112)
    prompt = [{"prompt": ref.chat_prompt([None, "say it again and again"]), "multi_modal_data": {"image": img}}]
    plain = run(llm, prompt, 16)[0]
    spec = LLM(str(checkpoint), dtype="float32", kv_cache_memory=32 << 20, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    try:
        out = run(spec, prompt, 16)[0]
    finally:
        spec.shutdown()
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.metrics.spec_proposed_tokens > 0


def test_async_engine_sends_images_to_the_engine_process(checkpoint, ref, llm):
    """The server's path: ``PromptInput.multi_modal_data``, preprocessed on the worker thread,
    the images crossing to the engine-core process in the request."""
    import asyncio

    from pagoda.config import EngineArgs
    from pagoda.engine.async_engine import AsyncEngine, PromptInput

    img = image(21, 70, 100)
    text = ref.chat_prompt([None, "what now"])
    ids = ref.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)

    async def generate() -> list:
        engine = AsyncEngine(EngineArgs(model=str(checkpoint), dtype="float32", kv_cache_memory=32 << 20))
        await engine.start()
        try:
            group = await engine.add_requests("a", [PromptInput(text, list(ids), params,
                                                                multi_modal_data={"image": img})])
            return await group.results()
        finally:
            await engine.shutdown()

    served = asyncio.run(generate())[0]
    offline = run(llm, [{"prompt": text, "multi_modal_data": {"image": img}}], N)[0]
    assert served.prompt_token_ids == offline.prompt_token_ids
    assert served.outputs[0].token_ids == offline.outputs[0].token_ids


def test_structured_output_with_an_image(llm, ref):
    import re

    from pagoda.structured_output.params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]))
    prompt = {"prompt": ref.chat_prompt([None, "cat or dog?"]), "multi_modal_data": {"image": image(22, 56, 84)}}
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert re.fullmatch("cat|dog", out.outputs[0].text)
