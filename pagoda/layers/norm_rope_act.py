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
    elif kind in ("yarn", "deepseek_yarn"):
        inv_freq = _yarn_scale(inv_freq, head_dim, theta, scaling or {})
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")
    return inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN scales cos/sin by this (``attention_factor``, else from ``factor``, ``mscale``
    and ``mscale_all_dim``); 1 for every other kind."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) not in ("yarn", "deepseek_yarn"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, float(s["mscale"])) / yarn_mscale(factor, float(s["mscale_all_dim"]))
    return yarn_mscale(factor)


def _yarn_scale(inv_freq: torch.Tensor, dim: int, base: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that rotate fewer than ``beta_slow`` times over the original context
    are interpolated by ``factor``, those above ``beta_fast`` kept, a linear ramp between."""
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp).double()
    freq = inv_freq.float().double()
    return freq / factor * (1 - extrapolate) + freq * extrapolate


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
        factor = rope_attention_factor(scaling)
        cache = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return fused_ops.apply_rotary(q, k, positions, self.cos_sin_cache)
