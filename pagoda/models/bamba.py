"""Bamba (``BambaForCausalLM``): Mamba-2 layers with attention at ``attn_layer_indices``, a
dense SiLU-gated MLP (``feed_forward``) in every layer, a final ``final_layernorm``; attention
with the usual ``head_dim ** -0.5`` scale and RoPE over half of each head (``partial_rotary_factor``
0.5 unless the config says otherwise). The engine treats it as ``granite_hybrid`` describes:
one recurrent-state slot per running sequence, no prefix reuse."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.norm_rope_act import RMSNorm
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import MLP, SelfAttention
from pagoda.models.granite_hybrid import GraniteMoeHybridForCausalLM, make_mixer
from pagoda.models.registry import bamba_layer_kinds


class BambaLayer(nn.Module):
    """Pre-norm mixer (Mamba-2 ``mamba`` or ``self_attn``), then the MLP after
    ``pre_ff_layernorm``; the ``(delta, residual)`` interface of ``DecoderLayer``."""

    cpu_decode = None  # never served by the fused CPU decode blocks

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None, prefix: str,
                 kind: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mamba = make_mixer(cfg, quant, f"{prefix}.mamba") if kind == "mamba" else None
        self.self_attn = SelfAttention(cfg, backend, quant, f"{prefix}.self_attn") if kind == "attention" else None
        self.feed_forward = MLP(cfg, quant, f"{prefix}.feed_forward")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        h = x if residual is None else x + residual
        y = self.input_layernorm(h)
        h = h + (self.mamba(positions, y) if self.mamba is not None else self.self_attn(positions, y))
        return self.feed_forward(self.pre_ff_layernorm(h)), h


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba checkpoints (dense MLPs; no multipliers)."""

    layer_kinds = staticmethod(bamba_layer_kinds)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        hf = cfg.hf_config
        if hf.get("mlp_bias"):
            raise ValueError("BambaForCausalLM with mlp_bias is not supported")
        rope = hf.get("rope_parameters") or {}
        factor = hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
        # The config always rotates half of each head unless it says otherwise (and the
        # checkpoint's config.json may not say it): fix it for ``make_rotary``.
        cfg = dataclasses.replace(cfg, hf_config={**hf, "partial_rotary_factor": factor})
        super().__init__(cfg, backend)

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        return BambaLayer(cfg, backend, quant, prefix, self.kinds[index])

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name.removeprefix("model.final_layernorm."), None
        return None
