"""RMSNorm, rotary position embedding and SiLU-and-mul as modules. The arithmetic lives in
``pagoda.layers.fused_ops`` (torch on CPU, fused Triton kernels on CUDA).

Beside them, the variants some families need: ``OffsetRMSNorm`` (a checkpoint that stores
``w`` for a scale of ``1 + w``: Gemma), ``GeluTanhAndMul`` (GeGLU), ``InterleavedRotaryEmbedding``
(GPT-J-style pairs: GLM-4) and LongRoPE frequencies (Phi-3)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
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


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint stores each scale as its offset from one (Gemma computes
    ``norm(x) * (1 + w)``). The parameter holds ``1 + w``, added once as the weight loads, in
    float32 so that a 16-bit checkpoint's small offsets are not rounded away; random (dummy)
    weights fill it with ones, as a zero offset would."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden, eps, torch.float32)
        self.weight.weight_loader = _load_offset_scale  # type: ignore[attr-defined]


def _load_offset_scale(param: nn.Parameter, source: object, shard: object = None) -> None:
    param.data.copy_(1.0 + torch.as_tensor(source[:]).float())  # type: ignore[index]


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :I]) * x[..., I:]`` (GeGLU with the tanh approximation of GELU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype)


def gated_activation(name: str | None) -> nn.Module:
    """The gated MLP activation a checkpoint names (``hidden_act`` / ``hidden_activation``)."""
    if name in (None, "silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return GeluTanhAndMul()
    raise ValueError(f"unsupported MLP activation {name!r} (supported: silu, gelu_pytorch_tanh)")


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
    elif kind in ("longrope", "su"):
        factors = (scaling or {})["long_factor" if (scaling or {}).get("use_long_factor") else "short_factor"]
        if len(factors) != len(inv_freq):
            raise ValueError(f"LongRoPE needs {len(inv_freq)} factors for a rotary size of {head_dim}, "
                             f"the checkpoint gives {len(factors)}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} "
                         "(supported: default, linear, llama3, yarn, longrope)")
    return inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN scales cos/sin by this (``attention_factor``, else from ``factor``, ``mscale``
    and ``mscale_all_dim``); 1 for every other kind."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) in ("longrope", "su"):
        return float(s.get("attention_factor") or 1.0)  # resolved by ``resolve_longrope``
    if s.get("rope_type", s.get("type")) not in ("yarn", "deepseek_yarn"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, float(s["mscale"])) / yarn_mscale(factor, float(s["mscale_all_dim"]))
    return yarn_mscale(factor)


def resolve_longrope(scaling: dict, max_position_embeddings: int, original_max: int,
                     max_model_len: int) -> dict:
    """LongRoPE (Phi-3's ``longrope``/``su``) as one fixed table: the long factors when this
    engine may run sequences past ``original_max`` (``max_model_len`` above it), else the short
    ones, for every position. (Switching per sequence length would give one token's key two
    rotations as its sequence grows.) A sequence longer than ``original_max`` thus sees exactly
    the frequencies transformers uses for it; with a short ``max_model_len`` every sequence sees
    the short ones, as there. The cos/sin scale is ``attention_factor``, else
    ``sqrt(1 + ln(factor) / ln(original_max))`` with ``factor`` the context extension."""
    factor = scaling.get("factor") or max_position_embeddings / original_max
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    return {**scaling, "rope_type": "longrope", "use_long_factor": max_model_len > original_max,
            "attention_factor": float(attention)}


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


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (M-RoPE, Qwen2-VL and later): each frequency rotates by one of three
    positions (temporal, height, width). ``sections`` gives how many frequencies read each
    axis: in three contiguous runs, or ``interleaved`` (Qwen3-VL: t, h, w, t, h, w, ... while
    each axis has some left). Positions ``[T]`` (text, every axis equal) take the plain table,
    so decode steps run exactly as on a text model; ``[3, T]`` pick per frequency."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, dtype: torch.dtype, sections: list[int],
                 interleaved: bool = False) -> None:
        super().__init__(head_dim, max_pos, theta, None, dtype)
        half = self.cos_sin_cache.shape[1] // 2
        if sum(sections) != half:
            raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {half}")
        if interleaved:
            axis = [0] * half
            for a in (1, 2):
                for i in range(a, 3 * sections[a], 3):
                    axis[i] = a
        else:
            axis = [a for a, n in enumerate(sections) for _ in range(n)]
        self.register_buffer("axis", torch.tensor(axis + axis), persistent=False)  # cos half, sin half

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        rows = self.cos_sin_cache[positions]  # [3, T, rot]
        index = self.axis.view(1, 1, -1).expand(1, rows.shape[1], -1)
        table = torch.take_along_dim(rows, index, dim=0)[0]  # [T, rot]: each token's own row
        return fused_ops.apply_rotary(q, k, torch.arange(rows.shape[1], device=q.device), table)


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """RoPE over interleaved pairs (dims ``2i``, ``2i+1`` rotate together, GPT-J style) of the
    first ``2 * len(inv_freq)`` dims of each head; the rest pass through (GLM-4's partial
    rotary). Plain torch ops on every device."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin_cache[positions].float().chunk(2, dim=-1)
        return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    even, odd = x[..., 0:rot:2].float(), x[..., 1:rot:2].float()
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((out, x[..., rot:]), dim=-1) if rot < x.shape[-1] else out
