"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's options.

- every norm scales by ``1 + w`` (``OffsetRMSNorm``), and each layer has four of them: before
  and after attention, before and after the MLP (``SandwichDecoderLayer``);
- token embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype);
- GeGLU MLPs (GELU, tanh approximation);
- scores scaled by ``query_pre_attn_scalar ** -0.5``;
- local (sliding-window) and global layers by ``layer_types`` (Gemma 2 alternates them, Gemma 3
  has five local layers to one global one); Gemma 3 rotates them with separate RoPE bases
  (``rope_parameters`` per layer type, or the older ``rope_local_base_freq``);
- Gemma 2's attention logit soft-capping (only backends that ``supports_softcap``) and the final
  logit soft-capping of both;
- Gemma 3's q/k norms (per head, offset scales).
"""
from __future__ import annotations

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.norm_rope_act import OffsetRMSNorm, gated_activation
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import MLP, DecoderForCausalLM, LayerNorms, SandwichDecoderLayer, SelfAttention, make_rotary

_NORMS = LayerNorms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")


class GatedMLP(MLP):
    """The dense gated MLP with the activation the checkpoint names (GeGLU for Gemma)."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(cfg, quant, prefix)
        hf = cfg.hf_config
        self.act = gated_activation(hf.get("hidden_activation") or hf.get("hidden_act"))


def layer_rope(cfg: ModelConfig, sliding: bool) -> tuple[float, dict | None]:
    """(theta, scaling) of a local (``sliding``) or global layer. Gemma 3 gives each layer type
    its own (``rope_parameters`` keyed by type; older configs: ``rope_local_base_freq`` for the
    local layers, ``rope_theta`` and ``rope_scaling`` for the global ones); Gemma 2 one for all."""
    hf = cfg.hf_config
    params = hf.get("rope_parameters") or {}
    kind = "sliding_attention" if sliding else "full_attention"
    if isinstance(params.get(kind), dict):
        own = params[kind]
        scaling = own if own.get("rope_type", own.get("type", "default")) != "default" else None
        return float(own.get("rope_theta", cfg.rope_theta)), scaling
    if sliding and hf.get("rope_local_base_freq") is not None:
        return float(hf["rope_local_base_freq"]), None
    return cfg.rope_theta, cfg.rope_scaling


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text only)."""

    make_norm = OffsetRMSNorm

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        if cfg.hf_config.get("use_bidirectional_attention"):  # an encoder (EmbeddingGemma), not a decoder
            raise ValueError(f"{cfg.architecture} with use_bidirectional_attention is not supported: "
                             "pagoda runs causal decoders only")
        super().__init__(cfg, backend)
        # Rounded to the dtype as the weights are, as the reference implementation does.
        self.model.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=cfg.dtype))
        self.final_softcap: float | None = cfg.hf_config.get("final_logit_softcapping")

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        window = cfg.sliding_windows[index] if index < len(cfg.sliding_windows) else None
        hf = cfg.hf_config

        def attention(cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                      prefix: str) -> nn.Module:
            theta, scaling = layer_rope(cfg, window is not None)
            scalar = hf.get("query_pre_attn_scalar") or cfg.head_dim
            return SelfAttention(cfg, backend, quant, prefix, window, rotary=make_rotary(cfg, theta, scaling),
                                 scale=float(scalar) ** -0.5, softcap=hf.get("attn_logit_softcapping"),
                                 norm=OffsetRMSNorm)

        def mlp(cfg: ModelConfig, index: int, quant: QuantizationConfig | None, prefix: str) -> nn.Module:
            return GatedMLP(cfg, quant, prefix)

        return SandwichDecoderLayer(cfg, backend, quant, prefix, index, _NORMS, attention, mlp, OffsetRMSNorm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
