"""RMSNorm, rotary position embedding and SiLU-and-mul as modules. The arithmetic lives in
``pagoda.layers.fused_ops`` (torch on CPU, fused Triton kernels on CUDA)."""
from __future__ import annotations

import math

import torch
from torch import nn

from pagoda.layers import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.silu_and_mul(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling or {})
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept,
    a smooth blend in between."""
    factor, low, high = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX-style) RoPE from a precomputed ``[max_pos, head_dim]`` cos|sin table."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).float()
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return fused_ops.apply_rotary(q, k, positions, self.cos_sin_cache)
