"""LLaVA with a SigLIP vision tower against transformers on random-weight checkpoints (float32,
CPU): greedy tokens and logprobs for one image, two images and a batch mixing text and image
prompts; the prefix cache keyed by image content. Two variants: a Llama decoder reading one
feature layer with every patch kept ("full"), and a Qwen2 decoder reading two feature layers
with the first row dropped ("default")."""
from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.tools.make_vlm import make_vlm
from vlm_helpers import ATOL, LLAVA_FAMILIES, check_greedy, image, load_reference, run, sampled_logprobs

N = 6


@pytest.fixture(scope="module", params=sorted(LLAVA_FAMILIES))
def family(request) -> str:
    return request.param


def test_single_image_matches_transformers(llm, ref):
    from pagoda.multimodal.processor import image_placeholder, is_multimodal

    assert is_multimodal(llm.config.model)
    assert image_placeholder(llm.config.model) == "<image>" in ref.chat_prompt([None])
    img = image(1, 60, 90)
    out = run(llm, [{"prompt": ref.chat_prompt([None, "what is in this picture?"]),
                     "multi_modal_data": {"image": img}}], N)[0]
    # The one placeholder became image_seq_length tokens (the patches, less a dropped first row).
    assert out.prompt_token_ids.count(ref.model.config.image_token_id) == ref.model.config.image_seq_length
    check_greedy(ref, out, [img])


def test_two_images_and_token_ids_prompt(llm, ref):
    imgs = [image(2, 64, 64), image(3, 90, 140)]
    ids = ref.tokenizer.encode(ref.chat_prompt(["compare", None, "with", None, "please"]), add_special_tokens=False)
    out = run(llm, [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}], N)[0]
    assert out.prompt_token_ids.count(ref.model.config.image_token_id) == 2 * ref.model.config.image_seq_length
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
    """The image comes early, so the first full block holds image tokens: the same image again is
    a hit; another image (identical token ids) is not."""
    llm.reset_prefix_cache()
    prompt = ref.chat_prompt([None, "describe it in a few words"])
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


def test_chunked_prefill_through_an_image(checkpoint, ref, llm):
    """A step budget smaller than an image's tokens: chunks start and end inside the image."""
    img = image(9, 112, 140)
    prompts = [{"prompt": ref.chat_prompt(["look", None, "and say"]), "multi_modal_data": {"image": img}}]
    whole = run(llm, prompts, N)[0]
    chunked = LLM(str(checkpoint), dtype="float32", kv_cache_memory=32 << 20, max_num_batched_tokens=8,
                  max_num_seqs=1, enable_prefix_caching=False)
    try:
        part = run(chunked, prompts, N)[0]
    finally:
        chunked.shutdown()
    assert part.outputs[0].token_ids == whole.outputs[0].token_ids
    assert sampled_logprobs(part) == pytest.approx(sampled_logprobs(whole), abs=ATOL)
    check_greedy(ref, part, [img])


def test_newer_weight_layout_loads_the_same(checkpoint, ref, llm, tmp_path):
    """The checkpoint rewritten with newer transformers' names (``model.language_model.*``,
    ``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``) gives the same
    greedy tokens and logprobs."""
    import shutil

    from safetensors.torch import load_file, save_file

    def newer(name: str) -> str:
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower.vision_model."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                return new + name[len(old):]
        raise AssertionError(f"unexpected checkpoint name {name}")

    for f in checkpoint.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    save_file({newer(k): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompt = [{"prompt": ref.chat_prompt([None, "again"]), "multi_modal_data": {"image": image(12, 50, 70)}}]
    renamed = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)
    try:
        out = run(renamed, prompt, N)[0]
    finally:
        renamed.shutdown()
    base = run(llm, prompt, N)[0]
    assert out.outputs[0].token_ids == base.outputs[0].token_ids
    assert sampled_logprobs(out) == pytest.approx(sampled_logprobs(base), abs=1e-6)


def test_placeholder_count_must_match_the_images(llm, ref):
    from pagoda.errors import ParamError

    two = ref.chat_prompt([None, None, "x"])  # adjacent <image><image>: two images
    with pytest.raises(ParamError, match="2 image placeholders for 1 images"):
        llm.generate({"prompt": two, "multi_modal_data": {"image": image(1, 40, 40)}}, use_tqdm=False)
    assert run(llm, [{"prompt": two, "multi_modal_data": {"image": [image(1, 40, 40)] * 2}}], 2)[0].finished


def test_a_clip_tower_is_refused(checkpoint, tmp_path):
    """Only SigLIP towers run: a LLaVA checkpoint with another tower fails at start-up, naming it."""
    import json
    import shutil

    for f in checkpoint.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vision_config"]["model_type"] = "clip_vision_model"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="SigLIP vision tower"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)


# ---- served: the official openai client with data: URLs -------------------------------------


def _data_url(im) -> str:
    import base64
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server on a Llama-decoder LLaVA checkpoint, and that checkpoint's reference."""
    from tests.entrypoints.server_helpers import start_server

    ckpt = make_vlm(tmp_path_factory.mktemp("llava_served"), arch="llava_siglip")
    srv = start_server(ckpt, tmp_path_factory.mktemp("llava-logs"), "--served-model-name", "llava")
    yield srv, load_reference(ckpt, "llava_siglip")
    srv.stop()


@pytest.mark.slow
def test_openai_client_data_urls_equal_transformers_and_cache_by_image(served):
    """Greedy replies to ``image_url`` parts equal transformers'; the same image again reads
    cached prompt tokens, another image with the same text reads none past the text before it."""
    import openai

    srv, ref = served
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    token = ref.model.config.image_token_id

    def ask(img):
        content = [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                   {"type": "text", "text": "what is in this picture, in a few words?"}]
        return client.chat.completions.create(model="llava", messages=[{"role": "user", "content": content}],
                                              max_tokens=N, temperature=0,
                                              extra_body={"ignore_eos": True, "skip_special_tokens": False})

    def expected(img) -> str:
        text = ref.chat_prompt([None, "what is in this picture, in a few words?"])
        ids: list[int] = []
        for t in ref.tokenizer.encode(text, add_special_tokens=False):
            ids += [t] * ref.model.config.image_seq_length if t == token else [t]
        return ref.tokenizer.decode(ref.greedy(ids, [img], N)[0], skip_special_tokens=False)

    first, second = image(30, 70, 50), image(31, 70, 50)
    a = ask(first)
    assert a.choices[0].message.content == expected(first)
    again, other = ask(first), ask(second)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == a.choices[0].message.content
    assert other.usage.prompt_tokens == a.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # the image sits in the first block
    assert other.choices[0].message.content == expected(second)


def test_throughput_benchmark_image_workload(llm, ref):
    """``bench throughput --images 2`` on LLaVA: each prompt opens with two ``<image>`` tokens kept
    apart by an ordinary one; pagoda expands each to the tower's fixed feature count, the count the
    Hugging Face peer expands to, and decodes as transformers does."""
    from pagoda.bench.common import Workload
    from pagoda.bench.hf_peer import _fixed_image_tokens, noise_image
    from pagoda.bench.throughput import with_images

    token = ref.model.config.image_token_id
    work = with_images(Workload([[token, 40, 41, 42], [43, 44]], [N, N]), llm.config.model.hf_config, 2)
    assert [p.count(token) for p in work.prompts] == [2, 2]  # the random text's image token was replaced
    images = [[noise_image(10 * i + j, 48, 80) for j in range(2)] for i in range(2)]
    outs = run(llm, [{"prompt_token_ids": p, "multi_modal_data": {"image": ims}}
                     for p, ims in zip(work.prompts, images)], N)
    for out, ims in zip(outs, images):
        assert out.prompt_token_ids.count(token) == 2 * _fixed_image_tokens(ref.model.config)
        check_greedy(ref, out, ims)
