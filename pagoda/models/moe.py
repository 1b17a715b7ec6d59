"""Mixture-of-experts members of the decoder family: Mixtral, Qwen2-MoE and Qwen3-MoE.

They are the shared decoder (attention, norms, RoPE) with a sparse MLP block in some or all
layers; this module says which layers, builds the block and maps the checkpoint's per-expert
tensors onto the stacked expert weights of ``pagoda.layers.moe.FusedMoE``.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import all_reduce
from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.moe import FusedMoE, softmax_topk
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import MLP, DecoderForCausalLM

# checkpoint projection name -> (stacked parameter, shard within an expert: 0 gate, 1 up, None down)
_EXPERT_PROJ = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None),
                "gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def map_expert_weight(name: str) -> tuple[str, object] | None:
    """``...experts.{e}.{proj}.weight`` -> (``...experts.w13_weight`` or ``w2_weight``, shard)."""
    m = _EXPERT_RE.search(name)
    if m is None:
        return None
    param, which = _EXPERT_PROJ[m.group(2)]
    expert = int(m.group(1))
    return name[:m.start()] + f".experts.{param}", (expert, which) if which is not None else expert


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert behind its sigmoid gate)."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hf = cfg.hf_config
        num_experts = hf.get("num_local_experts") or hf["num_experts"]
        self.top_k = hf["num_experts_per_tok"]
        # Mixtral always renormalises the kept weights; Qwen's configs say whether to.
        self.renormalize = bool(hf.get("norm_topk_prob", cfg.architecture == "MixtralForCausalLM"))
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts, False, cfg.dtype)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, hf.get("moe_intermediate_size") or cfg.intermediate_size,
                                cfg.dtype)
        shared = hf.get("shared_expert_intermediate_size") or 0
        self.shared_expert = MLP(cfg, quant, f"{prefix}.shared_expert", shared) if shared else None
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, cfg.dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        out = all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(cfg: ModelConfig, index: int) -> bool:
    hf = cfg.hf_config
    if cfg.architecture == "MixtralForCausalLM":
        return True
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    step = hf.get("decoder_sparse_step", 1) or 1
    return index not in (hf.get("mlp_only_layers") or []) and experts > 0 and (index + 1) % step == 0


class MoEForCausalLM(DecoderForCausalLM):
    """Mixtral, Qwen2-MoE, Qwen3-MoE: the decoder with ``SparseMoeBlock`` MLPs where the config
    puts them."""

    # Decode CUDA graphs capture these layers: on a GPU the experts run the Triton grouped GEMM,
    # which reads no value on the host (tests/layers/test_moe_capture.py); the CPU paths that
    # read each expert's token count never run on a GPU.
    cuda_graph_safe = True

    def make_mlp(self, cfg: ModelConfig, index: int, quant: QuantizationConfig | None, prefix: str) -> nn.Module:
        if is_sparse_layer(cfg, index):
            return SparseMoeBlock(cfg, quant, prefix)
        return MLP(cfg, quant, prefix)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        renamed = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
        return map_expert_weight(renamed) or ((renamed, None) if renamed != name else None)
