"""Quantized KV cache: int8 and fp8 storage with one scale per token and K/V head.

Format (every backend reads and writes exactly this). A layer's quantized cache is the usual
pair ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
storage dtype (``int8``, ``float8_e4m3fn`` or ``float8_e5m2``) plus, beside it, a pair
``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` in bfloat16. The head
vector ``x`` of one token is stored as ``clamp(x / s, -QMAX, QMAX)`` (rounded to the nearest
integer for int8, to the nearest fp8 value for fp8), where ``s`` is ``max|x| / QMAX`` rounded
*up* to a bf16 value, so ``|x| / s <= QMAX`` whatever rounding a backend's bf16 conversion
does; it is read back as ``stored * s``. QMAX is the largest finite value of the storage
type: 127, 448 (e4m3), 57344 (e5m2). The scale is rounded before quantizing, so what is
stored is exact with respect to the scale the readers see.

Why per token and head, for fp8 too: pagoda computes scales on the fly (checkpoints carry no
calibrated KV scales), a token's scale never changes once written (so a block is immutable,
which prefix caching and copy-on-write rely on), and a per-token amax cannot overflow the
format whatever the model's activation range (a fixed scale of 1.0 saturates e4m3 at 448,
which K outlier channels of real models exceed). Error per element: int8 at most
``max|x| / 254`` (times ``1 + 2^-7`` for the scale's rounding); fp8 half an ulp, a relative
2^-4 (e4m3) or 2^-3 (e5m2).

Cost: 2 scale bytes per token, head and K/V, so a token takes ``head_dim + 2`` bytes per head
against ``4 * head_dim`` in fp32: ``4 * D / (D + 2)`` times the tokens (3.76x at D = 32, 3.94x
at D = 128), and ``2 * D / (D + 2)`` against bf16.
"""
from __future__ import annotations

import torch

SCALE_DTYPE = torch.bfloat16
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Scale floor: an all-zero head vector gets a tiny scale instead of 0 (0 / 0 would be NaN).
MIN_AMAX = 1e-30


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def bytes_per_token_head(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) of one head takes in a cache of ``dtype``, scale included."""
    elem = torch.empty(0, dtype=dtype).element_size()
    scale = torch.empty(0, dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    return head_dim * elem + scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (stored values ``[..., D]`` in ``dtype``, scales ``[...]`` bf16)."""
    qmax = QMAX[dtype]
    x = x.float()
    exact = x.abs().amax(-1).clamp_min(MIN_AMAX) / qmax
    scale = exact.to(SCALE_DTYPE)
    low = scale.float() < exact  # rounded down: one bf16 ulp up (positive bf16 bits order like ints)
    scale = torch.where(low, (scale.view(torch.int16) + 1).view(SCALE_DTYPE), scale)
    y = (x / scale.float()[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values ``[..., D]`` and their scales ``[...]`` -> ``[..., D]`` in ``dtype``."""
    return (data.float() * scale.float()[..., None]).to(dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 when it is fp8 (several torch copy ops have no fp8 kernels), else ``t``."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def store(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``x [T, Hkv, D]`` into ``cache``/``scales`` at ``slot_mapping`` (all valid)."""
    nb, bs, h, d = cache.shape
    data, scale = quantize(x, cache.dtype)
    byte_view(cache).view(nb * bs, h, d).index_copy_(0, slot_mapping, byte_view(data))
    scales.view(nb * bs, h).index_copy_(0, slot_mapping, scale)


def allocate_scales(cache_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Zeroed scales for a cache of ``cache_shape`` (``[..., head_dim]``), None when ``dtype`` is
    not quantized. Zero scales make never-written slots read back as 0 (finite, like the zeroed
    float caches)."""
    if not is_quantized(dtype):
        return None
    return torch.zeros(cache_shape[:-1], dtype=SCALE_DTYPE, device=device)


def check_device_support(dtype: torch.dtype, device: torch.device) -> None:
    """fp8 e4m3 conversions need an sm_89+ GPU (Ada, Hopper); refuse at start-up, not mid-step."""
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer "
                             f"(this one is {major}.{minor}); use fp8_e5m2 or int8")
