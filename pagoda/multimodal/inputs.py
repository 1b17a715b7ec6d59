"""What crosses from the front end to the engine core for a prompt with images, torch-free.

An ``ImageInput`` is one image already preprocessed by the checkpoint's image processor: its
pixel values (float32 bytes), its patch grid, a hash of that content, and the run of
placeholder tokens ``[offset, offset + length)`` its features replace in the prompt.

The prefix cache keys a prompt's blocks by ``cache_key_ids``: the prompt's token ids with every
placeholder token replaced by a negative number drawn from its image's hash, so two prompts with
the same text and different images never share a block, and a repeated image does.
"""
from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    """One preprocessed image of a prompt.

    ``pixels``: float32 values ``[num_patches, patch_dim]`` in C order (``pixel_shape``);
    ``grid_thw``: the patch grid (temporal, height, width) before the spatial merge;
    ``hash``: hex digest of the pixel values and grid (the encoder cache's key);
    ``offset``, ``length``: the prompt positions of its placeholder tokens."""

    hash: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    pixel_shape: tuple[int, int]
    pixels: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def cache_key(self) -> int:
        """A negative id standing for this image's placeholder tokens in prefix-cache keys
        (never a vocabulary id; 60 bits of the content hash)."""
        return -1 - int(self.hash[:15], 16)


def cache_key_ids(prompt_ids: list[int], images: list[ImageInput]) -> list[int]:
    """``prompt_ids`` with each image's placeholder run replaced by that image's ``cache_key``."""
    keys = list(prompt_ids)
    for image in images:
        keys[image.offset:image.end] = [image.cache_key] * image.length
    return keys


def check_images(prompt_ids: list[int], images: list[ImageInput], image_token_id: int | None) -> None:
    """Raise ``ValueError`` unless ``images`` sit on runs of ``image_token_id`` inside the
    prompt, in order and without overlapping, and their pixel bytes match their shapes (what the
    engine core re-checks before a request can reach a forward pass)."""
    if image_token_id is None:
        raise ValueError("this model takes no images")
    last = 0
    for image in images:
        if not last <= image.offset < image.end <= len(prompt_ids) or image.length < 1:
            raise ValueError(f"image at [{image.offset}, {image.end}) lies outside the prompt or overlaps another")
        if any(t != image_token_id for t in prompt_ids[image.offset:image.end]):
            raise ValueError("an image's positions must hold the model's image placeholder token")
        rows, cols = image.pixel_shape
        if rows < 1 or cols < 1 or len(image.pixels) != 4 * rows * cols:
            raise ValueError("an image's pixel values do not match its shape")
        last = image.end
