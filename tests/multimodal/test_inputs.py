"""The torch-free image contract (``ImageInput``, prefix-cache keys, the engine core's re-check)
and the encoder cache's budget, without a model."""
from __future__ import annotations

import msgspec
import pytest
import torch

from pagoda.engine.messages import EngineCoreRequest
from pagoda.multimodal.encoder_cache import EncoderCache
from pagoda.multimodal.inputs import ImageInput, cache_key_ids, check_images
from pagoda.sampling_params import SamplingParams

TOKEN = 9
HF = {"image_token_id": TOKEN, "vision_config": {"spatial_merge_size": 2, "patch_size": 2, "temporal_patch_size": 1,
                                                 "in_channels": 1}}


def _image(offset: int, digest: str = "ab" * 16, grid=(1, 2, 4)) -> ImageInput:
    rows = grid[0] * grid[1] * grid[2]
    return ImageInput(digest, offset, rows // 4, grid, (rows, 4), bytes(16 * rows))


def test_cache_keys_stand_for_image_content():
    ids = [1, 2, TOKEN, TOKEN, 3]
    a, b = _image(2), _image(2, "cd" * 16)
    keys_a, keys_b = cache_key_ids(ids, [a]), cache_key_ids(ids, [b])
    assert keys_a[:2] == [1, 2] and keys_a[4] == 3
    assert keys_a[2] == keys_a[3] == a.cache_key < 0
    assert keys_a != keys_b and cache_key_ids(ids, [_image(2)]) == keys_a


def test_engine_core_recheck_refuses_inconsistent_images():
    ids = [1, TOKEN, TOKEN, 2, TOKEN, TOKEN]
    check_images(ids, [_image(1), _image(4)], HF)
    with pytest.raises(ValueError, match="takes no images"):
        check_images(ids, [_image(1)], None)
    with pytest.raises(ValueError, match="placeholder token"):
        check_images(ids, [_image(2)], HF)
    with pytest.raises(ValueError, match="outside the prompt or overlaps"):
        check_images(ids, [_image(4), _image(1)], HF)
    bad_grid = ImageInput("ab" * 16, 1, 2, (1, 2, 6), (8, 4), bytes(128))  # 12 patches, 8 rows
    with pytest.raises(ValueError, match="do not agree"):
        check_images(ids, [bad_grid], HF)


def test_images_cross_the_wire():
    req = EngineCoreRequest("r", [1, TOKEN, TOKEN], SamplingParams(max_tokens=2), 0.0, images=[_image(1)])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back.images == req.images and back.prompt_token_ids == req.prompt_token_ids


def test_encoder_cache_evicts_least_recent_past_budget():
    cache = EncoderCache(budget_bytes=3 * 16)
    for key in "abc":
        cache.put(key, torch.zeros(4))  # 16 bytes each
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", torch.zeros(4))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    cache.put("big", torch.zeros(100))  # alone past the budget: kept, everything else goes
    assert len(cache) == 1 and cache.get("big") is not None and cache.num_bytes == 400
