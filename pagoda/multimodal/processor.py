"""Front-end image preprocessing for vision-language models.

``ImagePreprocessor.process(token_ids, images)`` runs the checkpoint's own Hugging Face image
processor (``AutoImageProcessor`` from the model directory) on each image, expands each image's
placeholder token in the prompt into as many tokens as the encoder gives it features
(``grid_t * grid_h * grid_w / merge**2``, less a row LLaVA's "default" strategy drops; SigLIP's
whole ``[3, H, W]`` image is first cut into patch rows), and returns the expanded ids with one ``ImageInput``
per image. A prompt may name each image by one placeholder token (what chat templates render) or
by a run already expanded to the right length.

Bad input (not an image, placeholder count not matching the images, a text-only model) raises
``ParamError``: a 400 in the server, a ``ValueError`` offline.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any

from pagoda.config import ModelConfig
from pagoda.errors import ParamError, check
from pagoda.multimodal.inputs import ImageInput, fixed_grid, image_geometry, image_token_id

FIELD = "multi_modal_data"


def is_multimodal(model: ModelConfig) -> bool:
    """Whether the loaded model takes images (its architecture has a vision encoder)."""
    return model.is_multimodal


# What a prompt's text holds where an image goes, per architecture (what the chat templates of
# these checkpoints render for an image part).
IMAGE_PLACEHOLDERS = {
    "Qwen2_5_VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen3VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>",
    "LlavaForConditionalGeneration": "<image>",
}


def image_placeholder(model: ModelConfig) -> str | None:
    """The text standing for one image in a prompt for ``model`` (None: it takes no images)."""
    return IMAGE_PLACEHOLDERS.get(model.architecture)


def images_of(multi_modal_data: Any) -> list:
    """The images of a prompt's ``multi_modal_data`` (``{"image": image | [images]}``), each a
    ``PIL.Image.Image``; ``ParamError`` for anything else."""
    from PIL import Image

    check(isinstance(multi_modal_data, dict), FIELD, f"{FIELD} must be a dict such as {{'image': image}}")
    unknown = sorted(set(multi_modal_data) - {"image"})
    check(not unknown, FIELD, f"{FIELD}: unsupported modalities {unknown}; pagoda takes 'image'")
    images = multi_modal_data.get("image")
    if images is None:
        return []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for image in images:
        check(isinstance(image, Image.Image), FIELD,
              f"{FIELD}['image'] must be PIL images, got {type(image).__name__}")
    return images


class ImagePreprocessor:
    """The model's image processor and placeholder rules; thread-safe (the server runs big
    inputs on a worker thread)."""

    def __init__(self, model: ModelConfig) -> None:
        hf = model.hf_config
        self.model = model
        self.image_token_id: int = image_token_id(hf)  # type: ignore[assignment]
        self.merge, _, self.drop = image_geometry(hf)
        self.patch = int((hf.get("vision_config") or {}).get("patch_size", 14))
        side = fixed_grid(hf)
        # Tokens per image where every image has the same count (a fixed grid, LLaVA's).
        self.fixed_tokens = side * side // self.merge ** 2 - self.drop if side is not None else None
        self._processor: Any = None
        self._lock = threading.Lock()

    def _image_processor(self) -> Any:
        if self._processor is None:
            from transformers import AutoImageProcessor

            self._processor = AutoImageProcessor.from_pretrained(self.model.path)
        return self._processor

    def process(self, token_ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """Expanded prompt ids and the images' ``ImageInput``s, in prompt order."""
        runs = self._placeholder_runs(token_ids)
        check(len(runs) == len(images), "prompt", f"the prompt has {len(runs)} image placeholders for "
              f"{len(images)} images; put one per image where the image goes")
        with self._lock:
            processed = [self._preprocess(image) for image in images]
        out: list[int] = []
        inputs: list[ImageInput] = []
        cursor = 0
        for (start, length), (pixels, shape, grid) in zip(runs, processed):
            n = grid[0] * grid[1] * grid[2] // self.merge ** 2 - self.drop
            check(length in (1, n), "prompt", f"an image placeholder run has {length} tokens; the image needs "
                  f"one placeholder (or exactly {n})")
            out.extend(token_ids[cursor:start])
            digest = hashlib.blake2b(pixels, digest_size=16)
            digest.update(repr(grid).encode())
            inputs.append(ImageInput(digest.hexdigest(), len(out), n, grid, shape, pixels))
            out.extend([self.image_token_id] * n)
            cursor = start + length
        out.extend(token_ids[cursor:])
        return out, inputs

    def _placeholder_runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each image's run of the image token (maximal runs, split as
        ``_split`` says)."""
        runs: list[tuple[int, int]] = []
        tok = self.image_token_id
        i, n = 0, len(token_ids)
        while i < n:
            if token_ids[i] == tok:
                j = i
                while j < n and token_ids[j] == tok:
                    j += 1
                runs.extend(self._split(i, j - i))
                i = j
            else:
                i += 1
        return runs

    def _split(self, start: int, length: int) -> list[tuple[int, int]]:
        """A run of placeholder tokens as the images it stands for. Without delimiters around
        an image (LLaVA's ``<image>``), adjacent images make one run: with a fixed token count
        ``n`` per image, a run of a multiple of ``n`` is that many expanded images, any other run
        one image per token."""
        n = self.fixed_tokens
        if n is None or length == 1:
            return [(start, length)]
        size = n if length % n == 0 else 1
        return [(s, size) for s in range(start, start + length, size)]

    def _preprocess(self, image: Any) -> tuple[bytes, tuple[int, int], tuple[int, int, int]]:
        """(float32 pixel bytes, their [patches, dim] shape, the grid) of one image."""
        import numpy as np

        try:
            out = self._image_processor()(images=[image.convert("RGB")], return_tensors="np")
        except (OSError, ValueError) as exc:
            raise ParamError(FIELD, f"the image could not be processed: {exc}") from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if "image_grid_thw" in out:  # Qwen's processors give patch rows and their grid
            grid = tuple(int(v) for v in out["image_grid_thw"][0])
        else:  # one [channels, H, W] image (SigLIP's): cut into patch rows, row-major
            pixels, grid = _patches(pixels[0], self.patch)
        return pixels.tobytes(), (int(pixels.shape[0]), int(pixels.shape[1])), grid  # type: ignore[return-value]


def _patches(image: Any, patch: int) -> tuple[Any, tuple[int, int, int]]:
    """``[C, H, W]`` pixels as ``[h * w, C * patch * patch]`` rows (patch by patch, row-major;
    each row channel, then row, then column: a stride-``patch`` convolution's weight order) and
    the grid ``(1, h, w)``."""
    import numpy as np

    c, height, width = image.shape
    h, w = height // patch, width // patch
    rows = image[:, :h * patch, :w * patch].reshape(c, h, patch, w, patch).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(rows.reshape(h * w, c * patch * patch)), (1, h, w)
