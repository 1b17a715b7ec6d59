"""Images in conversations (pagoda.multimodal.chat_parts) without an engine: OpenAI's image_url
parts in each form, Anthropic image blocks and Responses input_image parts become template
image parts plus the images' sources in order; the chat template renders the model's
placeholder once per image; a text-only model and too many images are refused by name."""
from __future__ import annotations

import asyncio
import base64
import functools
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image
from pydantic import ValidationError

from pagoda.engine.input_processor import InputProcessor
from pagoda.entrypoints.anthropic.protocol import MessagesRequest
from pagoda.entrypoints.anthropic.serving import chat_request as anthropic_chat_request
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.responses_protocol import ResponsesRequest
from pagoda.entrypoints.openai.serving_chat import echo_text, prompt_ids, render_chat
from pagoda.entrypoints.openai.serving_common import APIError, invalid_request, validation_error_of
from pagoda.entrypoints.openai.serving_responses import input_messages
from pagoda.errors import ParamError
from pagoda.multimodal.chat_parts import check_image_count, split_images
from pagoda.multimodal.media import ImageLoader, load_images_sync
from pagoda.multimodal.options import MediaConfig
from pagoda.tokenizer import load_tokenizer

TEXT_ONLY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
VISION = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": {"depth": 2},
          "image_token_id": 7}


class _Model:
    """The two fields of ``ModelConfig`` that ``check_image_count`` reads."""

    def __init__(self, architecture: str, is_multimodal: bool) -> None:
        self.architecture, self.is_multimodal = architecture, is_multimodal


TEXT_MODEL = _Model("LlamaForCausalLM", False)
VISION_MODEL = _Model("Qwen2_5_VLForConditionalGeneration", True)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# A vision-language chat template's shape: list content, an image part rendered as the placeholder.
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}" + PLACEHOLDER + "{% elif p.type == 'text' %}{{ p.text }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


def png_url(color: tuple[int, int, int], size: tuple[int, int] = (6, 4)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, GREEN, BLUE = png_url((255, 0, 0)), png_url((0, 255, 0)), png_url((0, 0, 255))


@functools.lru_cache(maxsize=None)
def tokenizer_of(path: Path) -> Any:
    return load_tokenizer(str(path))


def processor(tokenizer_dir: Path, hf_config: dict, limit: str | None = None) -> InputProcessor:
    model = SimpleNamespace(max_model_len=512, vocab_size=512, hf_config=hf_config, architecture=hf_config["architectures"][0],
                            is_multimodal="vision_config" in hf_config)
    config = SimpleNamespace(model=model, media=MediaConfig.from_flags(None, None, limit))
    return InputProcessor(config, tokenizer_of(tokenizer_dir))  # type: ignore[arg-type]


def test_every_image_part_form_is_found_in_order() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare "},
            {"type": "image_url", "image_url": {"url": RED, "detail": "high"}},  # detail accepted, ignored
            {"type": "text", "text": " and "},
            {"type": "image_url", "image_url": GREEN}]},  # the shorthand string form
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"image_url": BLUE}, {"type": "text", "text": "and this?"}]},  # no type
    ]
    out, images = split_images(messages)
    assert [ref.source for ref in images] == [RED, GREEN, BLUE]
    assert [ref.where for ref in images] == ["messages[1].content[1]", "messages[1].content[3]",
                                            "messages[3].content[0]"]
    assert out[0] is messages[0] and out[2] is messages[2]  # text-only messages pass as they came
    assert out[1]["content"] == [{"type": "text", "text": "compare "}, {"type": "image"},
                                 {"type": "text", "text": " and "}, {"type": "image"}]
    assert out[3]["content"] == [{"type": "image"}, {"type": "text", "text": "and this?"}]


@pytest.mark.parametrize("part,needle", [
    ({"type": "image_url", "image_url": {"detail": "low"}}, "image_url.url"),
    ({"type": "image_url", "image_url": ""}, "image_url.url"),
    ({"type": "image"}, "give an image as an image_url part"),  # a placeholder with no image behind it
])
def test_malformed_image_parts_are_refused(part: dict, needle: str) -> None:
    with pytest.raises(ParamError) as err:
        split_images([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}])
    assert err.value.param == "messages" and needle in str(err.value) and "messages[0].content[1]" in str(err.value)


def test_text_only_model_and_image_count_limit() -> None:
    check_image_count(0, TEXT_MODEL, MediaConfig(), "messages")  # text is always fine
    with pytest.raises(ParamError) as err:
        check_image_count(1, TEXT_MODEL, MediaConfig(), "messages")
    assert err.value.param == "messages"
    assert "LlamaForCausalLM" in str(err.value) and "takes text only" in str(err.value)
    limited = MediaConfig.from_flags(None, None, '{"image": 2}')
    check_image_count(2, VISION_MODEL, limited, "messages")
    with pytest.raises(ParamError, match="3 images; at most 2 per prompt .*--limit-mm-per-prompt"):
        check_image_count(3, VISION_MODEL, limited, "messages")
    check_image_count(999, VISION_MODEL, MediaConfig(), "messages")  # vLLM's default limit
    with pytest.raises(ParamError, match="at most 999"):
        check_image_count(1000, VISION_MODEL, MediaConfig(), "messages")


def test_template_renders_the_placeholder_once_per_image(llama_dir: Path) -> None:
    ip = processor(llama_dir, VISION)
    raw, images = split_images([
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": RED}},
                                     {"type": "text", "text": "what is"},
                                     {"type": "image_url", "image_url": {"url": GREEN}}]},
        {"role": "assistant", "content": "colors"},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "image_url", "image_url": BLUE}]}])
    checked = ip.check_messages(raw)
    assert checked[0]["content"] == [{"type": "image"}, {"type": "text", "text": "what is"}, {"type": "image"}]
    assert checked[1]["content"] == "colors"
    text = ip.apply_chat_template(checked, True, VL_TEMPLATE)
    assert text.count(PLACEHOLDER) == len(images) == 3
    assert text.index("what is") < text.index("colors") < text.rindex(PLACEHOLDER)
    assert text.startswith("<|im_start|>user\n" + PLACEHOLDER + "what is" + PLACEHOLDER)
    # The images load in the same order (the contract: the i-th placeholder is the i-th image).
    loaded = load_images_sync(MediaConfig(), [(ref.source, ref.where) for ref in images], "messages")
    assert [im.getpixel((0, 0)) for im in loaded] == [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    # echo's text of a message with images is its text parts.
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": RED}, {"type": "text", "text": "b"}]}],
        "echo": True, "add_generation_prompt": False})
    assert echo_text(req, ip.check_messages(split_images([req.messages[0].template_input()])[0])) == "ab"


def test_prompt_dict_with_images_is_checked_against_the_model(llama_dir: Path) -> None:
    image = Image.new("RGB", (4, 4))
    text_only = processor(llama_dir, TEXT_ONLY)
    with pytest.raises(ParamError) as err:
        text_only.tokenize({"prompt": "<image> hi", "multi_modal_data": {"image": image}})
    assert err.value.param == "multi_modal_data" and "takes text only" in str(err.value)
    with pytest.raises(ParamError, match="at most 1 per prompt"):
        processor(llama_dir, VISION, '{"image": 1}').tokenize({"prompt": "x", "multi_modal_data": {"image": [image] * 2}})
    for bad, needle in [({"video": [image]}, "unsupported modality 'video'"), ({"image": ["x.png"]}, "PIL.Image"),
                        ([image], "must be a dict")]:
        with pytest.raises(ParamError, match=needle):
            text_only.tokenize({"prompt": "x", "multi_modal_data": bad})
    # A prompt without images is unchanged.
    assert text_only.tokenize({"prompt": "hi", "multi_modal_data": None})[0] == "hi"


def test_openai_request_models_take_image_parts_and_name_unknown_ones() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": RED, "detail": "auto"}}, {"image_url": GREEN}]}]})
    _, images = split_images([m.template_input() for m in req.messages])
    assert [ref.source for ref in images] == [RED, GREEN]
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {}}]}]})
    error = validation_error_of(err.value.errors())
    assert error.param == "messages" and "input_audio" in error.message


def test_anthropic_image_blocks_become_image_url_parts() -> None:
    data = RED.split(",", 1)[1]
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "text", "text": " ok"}]}]})
    chat = anthropic_chat_request(req)
    raw, images = split_images([m.template_input() for m in chat.messages])
    assert [ref.source for ref in images] == [RED, "https://example.com/a.png"]
    assert raw[0]["content"] == [{"type": "text", "text": "see "}, {"type": "image"}, {"type": "image"},
                                 {"type": "text", "text": " ok"}]
    # Anthropic's media types only; an image in an assistant turn is refused.
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": data}}]}]})
    assistant = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    with pytest.raises(APIError) as err:
        anthropic_chat_request(assistant)
    assert err.value.status == 400 and err.value.param == "messages"


def test_responses_input_image_becomes_an_image_url_part() -> None:
    req = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what color?"}, {"type": "input_image", "image_url": RED, "detail": "low"}]}]})
    messages = input_messages(req.input)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "what color?"},
                                                     {"type": "image_url", "image_url": {"url": RED}}]}]
    chat = ChatCompletionRequest.model_validate({"messages": messages})
    assert [ref.source for ref in split_images([m.template_input() for m in chat.messages])[1]] == [RED]
    by_file = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    with pytest.raises(APIError) as err:
        input_messages(by_file.input)
    assert err.value.param == "input" and "file_id" in err.value.message



class RecordingEngine:
    """What ``render_chat`` and ``prompt_ids`` use of ``AsyncEngine``, with a vision model's
    config: records the prompt handed to ``tokenize_prompt`` (the engine side of the contract)."""

    def __init__(self, ip: InputProcessor) -> None:
        self.input_processor, self.config = ip, ip.config
        self.handed: list[dict] = []

    async def apply_chat_template(self, messages: list, add_generation_prompt: bool, tools: Any, **kw: Any) -> str:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, VL_TEMPLATE)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.encode(text, add_special_tokens)

    async def tokenize_prompt(self, prompt: dict) -> tuple[str, list[int]]:
        self.handed.append(prompt)
        return prompt["prompt"], self.input_processor.encode(prompt["prompt"], False)

    async def process_images(self, data: dict, ids: list[int]) -> tuple[list[int], list]:
        return ids, []  # the image processor's side is tested with real checkpoints (test_qwen_vl.py)


def serve_chat(engine: RecordingEngine, messages: list) -> tuple[list[int], Any]:
    async def run() -> tuple[list[int], Any]:
        loader = ImageLoader(engine.config.media)
        try:
            req = ChatCompletionRequest.model_validate({"messages": messages})
            _, text, images = await render_chat(engine, req, None)  # type: ignore[arg-type]
            ids, data, _ = await prompt_ids(engine, loader, text, images, False)  # type: ignore[arg-type]
            return ids, data
        finally:
            await loader.aclose()

    return asyncio.run(run())


def test_server_hands_the_engine_vllms_prompt_form(llama_dir: Path) -> None:
    engine = RecordingEngine(processor(llama_dir, VISION, '{"image": 2}'))
    ids, data = serve_chat(engine, [{"role": "user", "content": [
        {"type": "text", "text": "left"}, {"type": "image_url", "image_url": {"url": RED, "detail": "low"}},
        {"type": "text", "text": "right"}, {"image_url": BLUE}]}])
    [handed] = engine.handed
    assert set(handed) == {"prompt", "multi_modal_data"} and handed["multi_modal_data"] is data
    assert handed["prompt"].count(PLACEHOLDER) == 2
    assert handed["prompt"].index("left") < handed["prompt"].index(PLACEHOLDER) < handed["prompt"].index("right")
    assert [im.getpixel((0, 0)) for im in data["image"]] == [(255, 0, 0), (0, 0, 255)]
    assert all(im.mode == "RGB" for im in data["image"]) and ids
    # Text-only conversations never reach the image path.
    ids, data = serve_chat(engine, [{"role": "user", "content": "plain"}])
    assert data is None and len(engine.handed) == 1


@pytest.mark.parametrize("url,needle", [
    ("data:image/png;base64,AAAA", "not a decodable image"),
    ("data:image/tiff;base64,AAAA", "not a supported image type"),
    ("https://example.com/cat.png", "fetches no image URLs"),
    ("file:///etc/passwd", "reads no local files"),
])
def test_server_refuses_bad_images_as_400s_naming_the_part(llama_dir: Path, url: str, needle: str) -> None:
    engine = RecordingEngine(processor(llama_dir, VISION))
    with pytest.raises(ParamError) as err:
        serve_chat(engine, [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                         {"type": "image_url", "image_url": {"url": url}}]}])
    error = invalid_request(err.value, set())
    assert error.status == 400 and error.param == "messages"
    assert needle in error.message and error.message.startswith("messages[0].content[1]:")
    assert engine.handed == []  # nothing reached the engine
    too_many = [{"role": "user", "content": [{"type": "image_url", "image_url": RED}] * 3}]
    with pytest.raises(ParamError, match="at most 2 per prompt"):
        serve_chat(RecordingEngine(processor(llama_dir, VISION, '{"image": 2}')), too_many)
