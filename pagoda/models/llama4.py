"""Llama 4 text (``Llama4ForCausalLM``; ``Llama4ForConditionalGeneration`` checkpoints load their
language model only) on the shared decoder.

What is its own:

- RoPE layers and NoPE layers (``no_rope_layers[i]``: 1 rotates, 0 does not). RoPE layers rotate
  interleaved pairs, L2-normalise q and k after the rotation (``use_qk_norm``) and attend only
  within their chunk of ``attention_chunk_size`` positions (chunked local attention); NoPE
  layers attend over everything and scale each query by ``1 + attn_scale * log(1 + floor((p +
  1) / floor_scale))`` at position ``p`` (``attn_temperature_tuning``);
- mixture-of-experts layers (``moe_layers``, else every ``interleave_moe_layer_step``-th) with a
  shared expert beside the routed ones: the router keeps the top-k logits, and each kept
  expert runs on the input scaled by the sigmoid of its logit (not on the input, weighted after);
  the other layers' MLPs are dense, of ``intermediate_size_mlp``;
- checkpoint names: ``feed_forward`` for the MLP, the routed experts STACKED (``gate_up_proj
  [E, H, 2I]`` with gate then up, ``down_proj [E, I, H]``); a multimodal checkpoint's language
  model under ``language_model.``, its vision tower and projector skipped.
"""
from __future__ import annotations

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import all_reduce
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.moe import FusedMoE
from pagoda.layers.norm_rope_act import InterleavedRotaryEmbedding
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import MLP, DecoderForCausalLM, DecoderLayer, SelfAttention

_LANGUAGE_MODEL = "language_model."
_VISION = ("vision_model.", "multi_modal_projector.")


def uses_rope(hf: dict, index: int) -> bool:
    """Whether layer ``index`` rotates q and k (``no_rope_layers``: 1 for yes; without it every
    ``no_rope_layer_interval``-th layer is NoPE)."""
    flags = hf.get("no_rope_layers")
    if flags:
        return bool(flags[index])
    return (index + 1) % int(hf.get("no_rope_layer_interval", 4)) != 0


def is_moe_layer(hf: dict, index: int) -> bool:
    layers = hf.get("moe_layers")
    if layers is not None:
        return index in layers
    step = int(hf.get("interleave_moe_layer_step", 1))
    return (index + 1) % step == 0


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(SelfAttention):
    """``SelfAttention`` with Llama 4's per-layer kind: RoPE (+ L2 q/k norm, chunked) or NoPE
    (+ query temperature by position)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None, prefix: str,
                 index: int, rotary: nn.Module) -> None:
        hf = cfg.hf_config
        self.use_rope = uses_rope(hf, index)
        types = hf.get("layer_types")
        chunked = types[index] == "chunked_attention" if types else self.use_rope
        chunk = hf.get("attention_chunk_size") if chunked else None
        super().__init__(cfg, backend, quant, prefix, rotary=rotary, chunk_size=int(chunk) if chunk else None)
        self.l2_norm = self.use_rope and bool(hf.get("use_qk_norm", True))
        self.temperature = (None if self.use_rope or not hf.get("attn_temperature_tuning", True)
                            else (float(hf.get("floor_scale", 8192)), float(hf.get("attn_scale", 0.1))))
        self.eps = cfg.rms_norm_eps

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.use_rope:
            q, k = self.rotary(positions, q, k)
            if self.l2_norm:
                q, k = _l2_norm(q, self.eps), _l2_norm(k, self.eps)
        elif self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q.float() * scales[:, None, None]).to(q.dtype)
        return self.attend(q, k, v)


class Llama4MoE(nn.Module):
    """Router, routed experts on router-scaled inputs, and the shared expert."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        hf = cfg.hf_config
        experts = hf["num_local_experts"]
        self.top_k = hf.get("num_experts_per_tok", 1)
        self.router = ReplicatedLinear(cfg.hidden_size, experts, False, cfg.dtype)
        self.experts = FusedMoE(experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype, stacked_layout="halves")
        self.shared_expert = MLP(cfg, quant, f"{prefix}.shared_expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        scores = torch.sigmoid(top.float())
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        # Each kept expert sees the input scaled by its score, so each slot is its own pass.
        routed = self.experts((x * scores[:, :1]).to(x.dtype), ones, ids[:, :1])
        for j in range(1, self.top_k):
            routed = routed + self.experts((x * scores[:, j:j + 1]).to(x.dtype), ones, ids[:, j:j + 1])
        return all_reduce(routed) + self.shared_expert(x)


class Llama4ForCausalLM(DecoderForCausalLM):
    # Decode CUDA graphs capture it: on a GPU the experts run the Triton grouped GEMM and the
    # chunked attention reads its bounds on the device (tests/layers/test_moe_capture.py).
    cuda_graph_safe = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        # One table for every RoPE layer, as long as this engine's sequences (Llama 4's
        # max_position_embeddings runs to millions of positions).
        # Held in a tuple until the layers adopt it (a module cannot be assigned before
        # nn.Module.__init__, which the base class runs and which builds the layers).
        self._rotary = (InterleavedRotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta,
                                                   cfg.rope_scaling, cfg.dtype),)
        super().__init__(cfg, backend)

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        rotary = self._rotary[0]

        def attention(cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                      prefix: str) -> nn.Module:
            return Llama4Attention(cfg, backend, quant, prefix, index, rotary)

        return DecoderLayer(cfg, backend, quant, prefix, index, self._mlp, attention)

    def _mlp(self, cfg: ModelConfig, index: int, quant: QuantizationConfig | None, prefix: str) -> nn.Module:
        if is_moe_layer(cfg.hf_config, index):
            return Llama4MoE(cfg, quant, prefix)
        return MLP(cfg, quant, prefix, cfg.hf_config.get("intermediate_size_mlp") or cfg.intermediate_size)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        renamed = name.removeprefix(_LANGUAGE_MODEL).replace(".feed_forward.", ".mlp.")
        for leaf, param in ((".experts.gate_up_proj", ".experts.w13_weight"), (".experts.down_proj", ".experts.w2_weight")):
            if renamed.endswith(leaf):
                return renamed[:-len(leaf)] + param, None
        for ckpt, (target, shard) in self.packed_modules.items():
            if f".{ckpt}." in renamed:
                return renamed.replace(f".{ckpt}.", f".{target}."), shard
        return (renamed, None) if renamed != name else None

    def skip_weight(self, name: str) -> bool:
        return name.startswith(_VISION)

    def stage_missing_prefixes(self) -> tuple[str, ...]:
        own = super().stage_missing_prefixes()
        return own + tuple(_LANGUAGE_MODEL + p for p in own)  # a multimodal checkpoint's names too
