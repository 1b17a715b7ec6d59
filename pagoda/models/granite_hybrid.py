"""Granite 4 hybrids (``GraniteMoeHybridForCausalLM``): Mamba-2 layers beside attention layers.

- ``layer_types`` names each layer: ``mamba`` (or ``linear_attention``) layers run the Mamba-2
  mixer (``pagoda.layers.mamba``) over a per-sequence recurrent state; ``attention`` (or
  ``full_attention``) layers run grouped-query attention over the paged KV cache, only they
  hold KV blocks;
- attention scores scaled by ``attention_multiplier``; RoPE only where
  ``position_embedding_type`` is ``rope`` (else no position encoding at all: the Mamba layers
  carry order);
- every layer's MLP is a shared SiLU-gated MLP (``shared_mlp``) plus, with
  ``num_local_experts > 0``, a top-k mixture of experts (``block_sparse_moe``) whose checkpoint
  stores all experts stacked (``input_linear [E, 2I, H]``, gate then up; ``output_linear``);
- token embeddings times ``embedding_multiplier``, each layer's two branches times
  ``residual_multiplier``, logits divided by ``logits_scaling``.

What the engine does for it: one recurrent-state slot per running sequence (see
``docs/architecture.md``, "Hybrid models"); no prefix reuse; no speculative decoding, tensor or
pipeline parallelism or LoRA (refused in ``config.py``).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.mamba import Mamba2Mixer
from pagoda.layers.moe import FusedMoE, softmax_topk
from pagoda.layers.norm_rope_act import RMSNorm, SiluAndMul
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import DecoderForCausalLM, SelfAttention, make_rotary
from pagoda.models.registry import layer_kinds

def _time_step_limit(hf: dict) -> tuple[float, float]:
    """``time_step_limit`` as floats; a saved infinity may read as a marker dict."""
    limit = hf.get("time_step_limit") or (0.0, math.inf)

    def value(v: Any) -> float:
        return float(v["__float__"]) if isinstance(v, dict) else float(v)

    return value(limit[0]), value(limit[1])


class NoRotary(nn.Module):
    """No position encoding: q and k pass through."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class _StackedTransposed:
    """A checkpoint tensor ``[E, A, B]`` read as ``[E, B, A]`` (expert by expert), the layout
    ``FusedMoE``'s stacked loader expects."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __getitem__(self, index: Any) -> torch.Tensor:
        return torch.as_tensor(self.source[index]).transpose(-1, -2)


class GraniteMoE(nn.Module):
    """Top-k routing (softmax over the kept logits) over stacked experts."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        hf = cfg.hf_config
        experts = hf["num_local_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.router = nn.Module()
        self.router.layer = ReplicatedLinear(cfg.hidden_size, experts, False, cfg.dtype)
        self.experts = FusedMoE(experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype, stacked_layout="halves")
        for param in (self.experts.w13_weight, self.experts.w2_weight):
            param.weight_loader = self._load_experts  # type: ignore[attr-defined]

    def _load_experts(self, param: nn.Parameter, source: Any, shard: object = None) -> None:
        self.experts._load_stacked(param, _StackedTransposed(source))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.router.layer(x), self.top_k, True)
        return self.experts(x, weights, ids)


class SharedMLP(nn.Module):
    """The dense SiLU-gated MLP every layer has; ``input_linear`` holds gate then up."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        size = cfg.hf_config["shared_intermediate_size"]
        self.input_linear = ReplicatedLinear(cfg.hidden_size, 2 * size, False, cfg.dtype, quant,
                                             f"{prefix}.input_linear")
        self.output_linear = ReplicatedLinear(size, cfg.hidden_size, False, cfg.dtype, quant,
                                              f"{prefix}.output_linear")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act(self.input_linear(x)))


def make_mixer(cfg: ModelConfig, quant: QuantizationConfig | None, prefix: str) -> Mamba2Mixer:
    hf = cfg.hf_config
    heads = hf["mamba_n_heads"]
    inner = int(hf.get("mamba_expand", 2) * cfg.hidden_size)
    head_dim = hf.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    return Mamba2Mixer(cfg.hidden_size, heads, head_dim, hf["mamba_d_state"], hf.get("mamba_n_groups", 1),
                       hf.get("mamba_d_conv", 4), hf.get("mamba_chunk_size", 256), cfg.rms_norm_eps,
                       bool(hf.get("mamba_conv_bias", True)), bool(hf.get("mamba_proj_bias", False)), cfg.dtype,
                       _time_step_limit(hf), quant, prefix)


class GraniteHybridLayer(nn.Module):
    """A pre-norm layer whose mixer is Mamba-2 (``mamba``) or attention (``self_attn``), then the
    shared MLP (+ experts); both branches scaled by ``residual_multiplier``. Same
    ``(delta, residual)`` interface as ``DecoderLayer``."""

    cpu_decode = None  # never served by the fused CPU decode blocks (see ``cpu_decode.attach``)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None, prefix: str,
                 kind: str) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.multiplier = float(hf.get("residual_multiplier", 1.0))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: SelfAttention | None = None
        if kind == "mamba":
            self.mamba = make_mixer(cfg, quant, f"{prefix}.mamba")
        else:
            rotary = make_rotary(cfg) if hf.get("position_embedding_type") == "rope" else NoRotary()
            self.self_attn = SelfAttention(cfg, backend, quant, f"{prefix}.self_attn", rotary=rotary,
                                           scale=float(hf.get("attention_multiplier", 1.0)))
        experts = hf.get("num_local_experts") or 0
        self.block_sparse_moe = GraniteMoE(cfg, quant, f"{prefix}.block_sparse_moe") if experts else None
        self.shared_mlp = SharedMLP(cfg, quant, f"{prefix}.shared_mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        h = x if residual is None else x + residual
        y = self.input_layernorm(h)
        y = self.mamba(positions, y) if self.mamba is not None else self.self_attn(positions, y)
        h = h + y * self.multiplier
        y = self.post_attention_layernorm(h)
        out = self.shared_mlp(y)
        if self.block_sparse_moe is not None:
            out = out + self.block_sparse_moe(y)
        return out * self.multiplier, h


class GraniteMoeHybridForCausalLM(DecoderForCausalLM):
    """Granite 4.0 hybrid models (MoE or dense), run in one process."""

    cuda_graph_safe = False  # the Mamba layers plan each step on the host

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        self.kinds = self.layer_kinds(cfg.hf_config)
        if len(self.kinds) != cfg.num_layers:
            raise ValueError(f"layer_types names {len(self.kinds)} layers, the model has {cfg.num_layers}")
        if "attention" not in self.kinds:
            raise ValueError(f"{cfg.architecture} without any attention layer is not supported")
        super().__init__(cfg, backend)
        multiplier = float(cfg.hf_config.get("embedding_multiplier", 1.0))
        self.model.embed_scale = multiplier if multiplier != 1.0 else None
        self.logits_scaling = float(cfg.hf_config.get("logits_scaling", 1.0))

    # Each layer's kind, "mamba" or "attention", from the checkpoint's config.
    layer_kinds = staticmethod(layer_kinds)

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        return GraniteHybridLayer(cfg, backend, quant, prefix, self.kinds[index])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def _layers(self) -> list[GraniteHybridLayer]:
        return list(self.model.layers[self.model.start:self.model.end])

    def attention_layers(self) -> list[SelfAttention]:
        """Only the attention layers hold KV blocks."""
        return [layer.self_attn for layer in self._layers() if layer.self_attn is not None]

    def state_layers(self) -> list[Mamba2Mixer]:
        """The layers with a recurrent state per sequence (``ModelRunner`` allocates it)."""
        return [layer.mamba for layer in self._layers() if layer.mamba is not None]

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        for ckpt, param in ((".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.w13_weight"),
                            (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.w2_weight")):
            if name.endswith(ckpt):
                return name[:-len(ckpt)] + param, None
        return None
