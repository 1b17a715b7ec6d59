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


def q6_k_blocks(arr: np.ndarray) -> np.ndarray:
    """``arr`` ``[rows, cols]`` (cols a multiple of 256) quantized to Q6_K as llama.cpp lays it
    out (no search for the best scales): per sub-block of 16 a scale ``max|w| / 31``, per
    super-block ``d = max|scale| / 127`` and int8 ``sc = round(scale / d)``, codes
    ``round(w / (d * sc)) + 32`` in 0..63; ``ql`` holds the codes' low nibbles, ``qh`` their two
    high bits, in the order ``gguf.quants`` decodes them."""
    rows, cols = arr.shape
    x = arr.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = np.abs(scale).max(-1) / 127
    sc = np.where(d[:, None] > 0, np.round(scale / np.where(d > 0, d, 1)[:, None]), 0).clip(-127, 127)
    step = (d[:, None] * sc)[..., None]
    q = (np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 8, 32)  # decoded row r = 4h + j: half h of the block, j = 2 * nibble + chunk
    low, high = q & 0xF, q >> 4
    ql = np.empty((q.shape[0], 2, 2, 32), np.uint8)  # [half, chunk, 32]: low nibble j=chunk, high j=2+chunk
    qh = np.zeros((q.shape[0], 2, 32), np.uint8)
    for h in range(2):
        for c in range(2):
            ql[:, h, c] = low[:, 4 * h + c] | (low[:, 4 * h + 2 + c] << 4)
        for j in range(4):
            qh[:, h] |= high[:, 4 * h + j] << (2 * j)
    d16 = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), d16], axis=1)
    return blocks.reshape(rows, -1)


def q4_k_blocks(arr: np.ndarray) -> np.ndarray:
    """``arr`` ``[rows, cols]`` quantized to Q4_K (no search): per sub-block of 32 a scale
    ``(max - min) / 15`` and a min ``min(w, 0)``, both as 6-bit multiples of the super-block's
    fp16 ``d`` / ``dmin``, codes 0..15, packed as ``gguf.quants`` decodes them."""
    rows, cols = arr.shape
    x = arr.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - low) / 15
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)).clip(0, 63).astype(np.uint8)
    mn = np.round(np.divide(-low, dminf, out=np.zeros_like(low), where=dminf > 0)).clip(0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.round(np.divide(x + (dminf * mn)[..., None], step, out=np.zeros_like(x), where=step > 0))
    q = q.clip(0, 15).astype(np.uint8)
    s = np.empty((x.shape[0], 12), np.uint8)
    s[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # byte i of chunk c: sub-blocks 2c (low), 2c+1
    head = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)], axis=1)
    return np.concatenate([head, s, qs], axis=1).reshape(rows, -1)


# Q4_K and Q6_K from the checkpoint's values, as a quantizer writes them (pagoda requantizes
# Q6_K and a layer mixing it with Q4_K, so their test needs realistic blocks: random sub-block
# scales spread a row over orders of magnitude no quantizer writes); the other K-quants random.
K_ENCODERS = {**{name: (lambda arr, name=name: random_k_blocks(arr, name)) for name in K_LAYOUTS},
              "Q4_K": q4_k_blocks, "Q6_K": q6_k_blocks}


def export(model_dir: Path, out: Path, ftype: str, tensor_types: dict[str, str] | None = None) -> Path:
    from pagoda.bench.gguf_export import write_gguf

    return write_gguf(model_dir, out, ftype, tensor_types=tensor_types, encoders=K_ENCODERS)


def per_layer(types: dict[str, str], num_layers: int) -> dict[str, str]:
    """``{"attn_q": "Q4_K", ...}`` for every layer as GGUF tensor names (``blk.N.attn_q.weight``)."""
    return {f"blk.{i}.{part}.weight": t for i in range(num_layers) for part, t in types.items()}
