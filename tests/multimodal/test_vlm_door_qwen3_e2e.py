"""Qwen3-VL served through the front door: a random Qwen3-VL checkpoint (``make_vlm``: interleaved
M-RoPE, DeepStack features, learned vision positions) behind ``pagoda serve``, asked with images
as ``data:`` URLs through the official ``openai`` client. Greedy tokens must equal
``transformers``' on the same checkpoint, images and expanded prompt; a repeated image is a
prefix-cache hit and a different one with the same text is not; the same conversation
through the Anthropic Messages API (image blocks, official ``anthropic`` client) and the
Responses API (``input_image``) gives the same tokens. One server for the module."""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image

from vlm_helpers import image as noise_image
from vlm_helpers import load_reference

ARCH = "Qwen3VLForConditionalGeneration"
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.skipif(not hasattr(transformers, ARCH), reason=f"transformers has no {ARCH}"),
              pytest.mark.slow]  # a server

MAX_NEW = 6
# Parts of one user turn: strings are text, images image_url parts.
CASES = {"one image": ("What is this?", noise_image(31, 48, 64)),
         "two images": (noise_image(32, 64, 64), "and", noise_image(33, 40, 72), "differ how?")}


def png_b64(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def data_url(im: Image.Image) -> str:
    return "data:image/png;base64," + png_b64(im)


def chat_messages(parts: tuple) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p), "detail": "high"}} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagoda.tools.make_vlm import make_vlm

    return make_vlm(tmp_path_factory.mktemp("qwen3_vl"), arch="qwen3_vl")


@pytest.fixture(scope="module")
def expected(ckpt: Path) -> dict[str, tuple[list[int], int]]:
    """transformers' greedy tokens per case and the expanded prompt's length: the template text,
    each ``<|image_pad|>`` expanded to its image's merged patch count (the family's processor's
    rule), float32."""
    ref = load_reference(ckpt, "qwen3_vl")
    pad = ref.model.config.image_token_id
    merge = ref.model.config.vision_config.spatial_merge_size
    out = {}
    for name, parts in CASES.items():
        images = [p for p in parts if not isinstance(p, str)]
        text = ref.chat_prompt([p if isinstance(p, str) else None for p in parts])
        grids = iter(ref.image_processor(images=images, return_tensors="pt")["image_grid_thw"].tolist())
        ids: list[int] = []
        for token in ref.tokenizer.encode(text, add_special_tokens=False):
            if token == pad:
                t, h, w = next(grids)
                ids += [pad] * (t * h * w // merge ** 2)
            else:
                ids.append(token)
        assert ids.count(pad) > len(images)  # each placeholder became many feature rows
        out[name] = ref.greedy(ids, images, MAX_NEW)[0], len(ids)
    return out


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.entrypoints.server_helpers import start_server

    srv = start_server(ckpt, tmp_path_factory.mktemp("qwen3-vl-logs"), "--served-model-name", "vlm",
                       "--limit-mm-per-prompt", '{"image": 2}')
    yield srv
    srv.stop()


def decoded(ckpt: Path, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt).decode(tokens, skip_special_tokens=False)


GREEDY = {"ignore_eos": True, "skip_special_tokens": False}


def test_openai_client_data_urls_equal_transformers(server: Any, ckpt: Path, expected: dict) -> None:
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for case, parts in CASES.items():
        reply = client.chat.completions.create(model="vlm", messages=chat_messages(parts), max_tokens=MAX_NEW,
                                               temperature=0, logprobs=True, extra_body=GREEDY)
        tokens, num_prompt = expected[case]
        assert reply.choices[0].message.content == decoded(ckpt, tokens), case
        assert len(reply.choices[0].logprobs.content) == MAX_NEW
        assert reply.usage.prompt_tokens == num_prompt  # the images' feature rows were counted
    # The prefix cache (the bar): the same images again hit the blocks holding their tokens; another
    # first image of the same size, same text, hits nothing (it starts in the first block).
    parts = CASES["two images"]
    again = client.chat.completions.create(model="vlm", messages=chat_messages(parts), max_tokens=MAX_NEW,
                                           temperature=0, extra_body=GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == decoded(ckpt, expected["two images"][0])
    other = client.chat.completions.create(model="vlm", messages=chat_messages((noise_image(34, 64, 64), *parts[1:])),
                                           max_tokens=MAX_NEW, temperature=0, extra_body=GREEDY)
    assert other.usage.prompt_tokens == again.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="vlm", max_tokens=2, messages=chat_messages(
            (noise_image(1, 32, 32),) * 3))
    assert err.value.body["param"] == "messages" and "at most 2 per prompt" in err.value.body["message"]


def test_anthropic_image_blocks_and_responses_input_image_equal_transformers(server: Any, ckpt: Path,
                                                                             expected: dict) -> None:
    """The same one-image conversation through the other two APIs that take images."""
    import anthropic
    import openai

    text, im = CASES["one image"]
    want = decoded(ckpt, expected["one image"][0])
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(im)}}
    message = claude.messages.create(model="vlm", max_tokens=MAX_NEW, extra_body={**GREEDY, "temperature": 0},
                                     messages=[{"role": "user", "content": [{"type": "text", "text": text}, block]}])
    assert message.content[0].text == want
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.responses.create(model="vlm", max_output_tokens=MAX_NEW, temperature=0, extra_body=GREEDY,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": text},
                                           {"type": "input_image", "image_url": data_url(im), "detail": "low"}]}])
    assert response.output_text == want
