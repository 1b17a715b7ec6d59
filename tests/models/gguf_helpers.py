"""GGUF test files: the shared tiny checkpoints written as GGUF (``pagoda.bench.gguf_export``),
plus an encoder for the K-quants, which gguf-py can read but not write.

The K-quant "encoder" does not approximate the checkpoint's weights: it fills each block with
random codes and scales (every byte pattern is a valid block) and sets the block's fp16 scale
fields so the decoded weights have the checkpoint tensor's spread and about zero mean. The
oracle reads the same file, so what matters is that the blocks are valid and varied."""
from __future__ import annotations

from pathlib import Path

import numpy as np

# Type -> (bytes per block of 256, offset of d, offset of dmin or None).
K_LAYOUTS = {"Q2_K": (84, 80, 82), "Q3_K": (110, 108, None), "Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2),
             "Q6_K": (210, 208, None)}


def _set_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    raw = np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)
    blocks[..., offset:offset + 2] = raw


def _decode(blocks: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    import gguf
    from gguf import quants

    return quants.dequantize(blocks.reshape(shape[0], -1), gguf.GGMLQuantizationType[qtype]).reshape(shape)


def random_k_blocks(arr: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """Valid ``qtype`` blocks for a ``[rows, cols]`` tensor (cols a multiple of 256) whose
    decoded values have ``arr``'s standard deviation and a mean near zero."""
    size, d_at, dmin_at = K_LAYOUTS[qtype]
    rows, cols = arr.shape
    rng = np.random.default_rng(seed + rows * 7919 + cols)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    ones, zeros = np.ones(blocks.shape[:2]), np.zeros(blocks.shape[:2])
    _set_f16(blocks, d_at, ones)
    if dmin_at is None:
        base = _decode(blocks, qtype, arr.shape)
        ratio = 0.0
    else:  # w = d * (scale part) - dmin * (min part): centre with the ratio of their means
        _set_f16(blocks, dmin_at, zeros)
        scale_part = _decode(blocks, qtype, arr.shape)
        _set_f16(blocks, d_at, zeros)
        _set_f16(blocks, dmin_at, ones)
        min_part = _decode(blocks, qtype, arr.shape)
        ratio = -scale_part.mean() / min_part.mean() if min_part.mean() else 0.0
        base = scale_part + ratio * min_part
    d = float(arr.std()) / float(base.std())
    _set_f16(blocks, d_at, ones * d)
    if dmin_at is not None:
        _set_f16(blocks, dmin_at, ones * d * ratio)
    return blocks.reshape(rows, -1)


K_ENCODERS = {name: (lambda arr, name=name: random_k_blocks(arr, name)) for name in K_LAYOUTS}


def export(model_dir: Path, out: Path, ftype: str, tensor_types: dict[str, str] | None = None) -> Path:
    from pagoda.bench.gguf_export import write_gguf

    return write_gguf(model_dir, out, ftype, tensor_types=tensor_types, encoders=K_ENCODERS)


def per_layer(types: dict[str, str], num_layers: int) -> dict[str, str]:
    """``{"attn_q": "Q4_K", ...}`` for every layer as GGUF tensor names (``blk.N.attn_q.weight``)."""
    return {f"blk.{i}.{part}.weight": t for i in range(num_layers) for part, t in types.items()}
