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


def image_token_id(hf_config: dict) -> int | None:
    """The placeholder token of a vision-language checkpoint (``image_token_id``, or LLaVA's
    ``image_token_index``); None for a model that takes no images."""
    token = hf_config.get("image_token_id", hf_config.get("image_token_index"))
    return int(token) if token is not None else None


def image_geometry(hf_config: dict) -> tuple[int, int, int]:
    """(spatial merge, pixel values per patch row, placeholder tokens dropped per image) of a
    checkpoint's vision tower. A SigLIP tower (LLaVA) takes patches one by one, each
    ``channels * patch**2`` wide, and under ``vision_feature_select_strategy`` "default" drops
    its first feature row; Qwen's merge ``spatial_merge_size**2`` patches of two frames each."""
    vision = hf_config.get("vision_config") or {}
    patch = int(vision.get("patch_size", 14))
    if vision.get("model_type") == "siglip_vision_model":
        drop = int(hf_config.get("vision_feature_select_strategy", "default") == "default")
        return 1, int(vision.get("num_channels", 3)) * patch * patch, drop
    merge = int(vision.get("spatial_merge_size", 2))
    return merge, int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2)) * patch * patch, 0


def fixed_grid(hf_config: dict) -> int | None:
    """The side of the one patch grid a tower with fixed position embeddings takes (SigLIP:
    ``image_size // patch_size``), None where the grid follows the image."""
    vision = hf_config.get("vision_config") or {}
    if vision.get("model_type") == "siglip_vision_model":
        return int(vision["image_size"]) // int(vision["patch_size"])
    return None


def check_images(prompt_ids: list[int], images: list[ImageInput], hf_config: dict | None) -> None:
    """Raise ``ValueError`` unless ``images`` fit the model (``hf_config``: a vision-language
    checkpoint's config.json; None: a model that takes no images) and the prompt: each on a run
    of the image token inside the prompt, in order, not overlapping, its run as long as its merged
    grid (less any dropped rows) and its pixel rows one per patch of the grid's patch width. What
    the engine core re-checks before a request can reach a forward pass (a mismatch would fail
    the whole step)."""
    token = image_token_id(hf_config) if hf_config is not None else None
    if token is None:
        raise ValueError("this model takes no images")
    merge, width, drop = image_geometry(hf_config)
    side, last = fixed_grid(hf_config), 0
    for image in images:
        if not last <= image.offset < image.end <= len(prompt_ids):
            raise ValueError(f"image at [{image.offset}, {image.end}) lies outside the prompt or overlaps another")
        if any(t != token for t in prompt_ids[image.offset:image.end]):
            raise ValueError("an image's positions must hold the model's image placeholder token")
        t, h, w = image.grid_thw
        rows, cols = image.pixel_shape
        if (min(t, h, w) < 1 or h % merge or w % merge or image.length != t * h * w // (merge * merge) - drop
                or rows != t * h * w or cols != width or len(image.pixels) != 4 * rows * cols
                or (side is not None and (t, h, w) != (1, side, side))):
            raise ValueError("an image's grid, pixel values and placeholder count do not agree")
        last = image.end
