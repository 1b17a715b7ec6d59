"""Images in chat messages: OpenAI's ``image_url`` content parts (and the other APIs' image
blocks, translated to them) become ``{"type": "image"}`` parts, which Hugging Face chat
templates render as the model's image placeholder, and the images' sources are collected in
order.

Accepted part forms (as vLLM accepts them): ``{"type": "image_url", "image_url": {"url": ...,
"detail": ...}}`` (``detail`` is accepted and ignored: the model's own processor sizes the
image), ``{"type": "image_url", "image_url": "<url>"}``, ``{"image_url": "<url>"}`` with no type,
and offline only ``{"type": "image_pil", "image_pil": PIL.Image}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pagoda.errors import ParamError, check
from pagoda.multimodal.options import MediaConfig

IMAGE_PART_TYPES = ("image_url", "image_pil")


@dataclass(frozen=True)
class ImageRef:
    """One image of a conversation: its source (a URL string or an in-process image) and where
    it was in the request (``messages[0].content[1]``), for error messages."""

    source: Any
    where: str


def is_image_part(part: Any) -> bool:
    if not isinstance(part, Mapping):
        return False
    kind = part.get("type")
    return kind in IMAGE_PART_TYPES or (kind is None and "image_url" in part)


def split_images(messages: list[Any], param: str = "messages") -> tuple[list[Any], list[ImageRef]]:
    """``messages`` with each image part replaced by ``{"type": "image"}`` (the message's text
    parts kept as parts around it), and the images' sources in order. Messages without image
    parts are returned as they came; other problems are left for ``check_messages``."""
    out: list[Any] = []
    images: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, (list, tuple)):
            out.append(message)
            continue
        for j, part in enumerate(content):
            # A bare placeholder would stand for no image: images come as image_url parts.
            check(not (isinstance(part, Mapping) and part.get("type") == "image"), param,
                  f"{param}[{i}].content[{j}]: give an image as an image_url part "
                  "({'type': 'image_url', 'image_url': {'url': ...}})")
        if not any(is_image_part(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{param}[{i}].content[{j}]"
            if is_image_part(part):
                images.append(ImageRef(_source(part, where, param), where))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def _source(part: Mapping[str, Any], where: str, param: str) -> Any:
    if part.get("type") == "image_pil":
        check("image_pil" in part, param, f"{where}: an image_pil part needs 'image_pil' (a PIL image)")
        return part["image_pil"]
    value = part.get("image_url")
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ParamError(param, f"{where}: an image_url part needs image_url.url, a data: or http(s):// URL")
    return value


# ---- which models take images ---------------------------------------------------------------

def check_image_count(count: int, model: Any, config: MediaConfig, param: str) -> None:
    """Refuse a prompt with images for a model that takes none (``model``: the engine's
    ``ModelConfig``, whose ``is_multimodal`` the model registry decides), or with more than the
    limit."""
    if count == 0:
        return
    check(model.is_multimodal, param,
          f"{param} holds {count} image{'s' if count > 1 else ''}, but the served model ({model.architecture}) takes "
          "text only; send text content, or serve a vision-language model")
    limit = config.image_limit
    check(count <= limit, param, f"{param} holds {count} images; at most {limit} per prompt "
          "(the server's --limit-mm-per-prompt)")


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or its text parts joined (images left out)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping) and p.get("type") == "text")


# ---- the other APIs' image blocks, as image_url parts --------------------------------------------

def anthropic_image_part(source: Mapping[str, Any]) -> dict[str, Any]:
    """The ``image_url`` part of an Anthropic image block's ``source`` (``base64`` or ``url``)."""
    if source.get("type") == "base64":
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    return {"type": "image_url", "image_url": {"url": source["url"]}}
