"""DeepSeek-V3 (and DeepSeek-R1, which shares it): the shared decoder with multi-head latent
attention (``layers/attention/mla.py``) in every layer, dense MLPs in the first
``first_k_dense_replace`` layers and a mixture of experts with shared experts after them
(sigmoid scores, grouped top-k with the score-correction bias, ``routed_scaling_factor``)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import all_reduce
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.attention.mla import MLAAttention
from pagoda.layers.moe import FusedMoE, grouped_topk
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import MLP, DecoderForCausalLM
from pagoda.models.moe import map_expert_weight

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class Router(nn.Module):
    """The gate: fp32 logits of every expert and the per-expert score-correction bias."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        hf = cfg.hf_config
        num_experts = hf["n_routed_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.num_groups, self.topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
        self.renormalize = bool(hf.get("norm_topk_prob", True))
        self.scaling = float(hf.get("routed_scaling_factor", 1.0))
        self.gate = Router(cfg.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, hf["moe_intermediate_size"], cfg.dtype)
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = (MLP(cfg, quant, f"{prefix}.shared_experts", hf["moe_intermediate_size"] * shared)
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = grouped_topk(self.gate(x), self.top_k, self.num_groups, self.topk_groups,
                                    self.gate.e_score_correction_bias, self.renormalize, self.scaling)
        out = all_reduce(self.experts(x, weights, ids))
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    # Attention projections keep their checkpoint names (no fused q/k/v); only the dense MLPs fuse.
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # Decode CUDA graphs capture it: on a GPU the experts run the Triton grouped GEMM and MLA its
    # latent kernel, neither reading a value on the host (tests/layers/test_moe_capture.py).
    cuda_graph_safe = True

    def make_mlp(self, cfg: ModelConfig, index: int, quant: QuantizationConfig | None, prefix: str) -> nn.Module:
        if index >= (cfg.hf_config.get("first_k_dense_replace") or 0) and cfg.hf_config.get("n_routed_experts"):
            return DeepseekMoE(cfg, quant, prefix)
        return MLP(cfg, quant, prefix)

    def make_attention(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                       prefix: str) -> nn.Module:
        return MLAAttention(cfg, backend, quant, prefix)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        return map_expert_weight(name)

    def skip_weight(self, name: str) -> bool:
        """Layers past ``num_hidden_layers`` are the multi-token-prediction module, which
        pagoda does not run."""
        m = _LAYER_RE.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_layers
