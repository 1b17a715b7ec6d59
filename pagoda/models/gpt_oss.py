"""gpt-oss (``GptOssForCausalLM``) on the shared decoder.

What is its own:

- attention with q/k/v/o biases and a learned sink logit per head (``SelfAttention(sinks=True)``:
  the sink joins each row's softmax denominator), alternating sliding-window and full layers
  (``layer_types``), YaRN RoPE (the shared ``make_rotary``);
- a mixture of experts in every layer: a router with a bias, top-k of its logits and a softmax
  over the kept ones; experts with biases on both projections and the clamped SwiGLU
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``;
  the checkpoint stacks the experts (``gate_up_proj [E, H, 2I]`` with gate and up interleaved,
  ``down_proj [E, I, H]``), in bf16 or, as published, MXFP4 (dequantized at load:
  ``layers/quantization/mxfp4.py``).

The experts run in torch, one grouped matmul per active expert (the fused CPU and Triton expert
kernels compute the plain SiLU-gated MLP without biases).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import all_reduce
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.moe import FusedMoE, softmax_topk
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import DecoderForCausalLM, DecoderLayer, SelfAttention


class ClampedSwigluExperts(FusedMoE):
    """``FusedMoE`` whose experts add biases and apply gpt-oss's clamped SwiGLU; loaded from
    STACKED checkpoint tensors with gate and up interleaved."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 alpha: float, limit: float) -> None:
        super().__init__(num_experts, hidden, intermediate, dtype, stacked_layout="interleaved")
        self.alpha, self.limit = alpha, limit
        e, i = self.num_experts, self.intermediate
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(e, hidden, dtype=dtype), requires_grad=False)
        self.w13_bias.weight_loader = self._load_w13_bias  # type: ignore[attr-defined]
        self.w2_bias.weight_loader = self._load_w2_bias  # type: ignore[attr-defined]

    def _load_w13_bias(self, param: nn.Parameter, source: Any, shard: object = None) -> None:
        i, r = self.intermediate, self.slice_rank
        for local in range(self.num_experts):
            b = source[self.first_expert + local:self.first_expert + local + 1][0]
            param.data[local, :i].copy_(b[0::2][r * i:(r + 1) * i])
            param.data[local, i:].copy_(b[1::2][r * i:(r + 1) * i])

    def _load_w2_bias(self, param: nn.Parameter, source: Any, shard: object = None) -> None:
        param.data.copy_(source[self.first_expert:self.first_expert + self.num_experts])

    def pack_weight(self, grouped_kernel: bool = True) -> bool:
        return False  # the packed CPU kernels have no biases or clamped SwiGLU: on a CPU the torch path runs

    def triton_options(self) -> dict[str, Any]:
        """The GPU grouped GEMM adds both biases and applies the clamped SwiGLU."""
        return dict(w13_bias=self.w13_bias, w2_bias=self._w2_bias(), activation=self._clamped_swiglu)

    def _w2_bias(self) -> torch.Tensor | None:
        # Under tensor parallelism the ranks' outputs are summed: one of them adds the bias.
        return self.w2_bias if self.slice_rank == 0 else None

    def _clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        h = self._clamped_swiglu(F.linear(rows, self.w13_weight[e], self.w13_bias[e]))
        bias = self._w2_bias()
        return F.linear(h, self.w2_weight[e], bias[e] if bias is not None else None)


class GptOssMoE(nn.Module):
    """Router (with bias) + experts; the output is all-reduced across ranks."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        experts = hf["num_local_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.router = ReplicatedLinear(cfg.hidden_size, experts, True, cfg.dtype)
        self.experts = ClampedSwigluExperts(experts, cfg.hidden_size, cfg.intermediate_size, cfg.dtype,
                                            float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A softmax over the top-k logits: the softmax over all, kept and renormalised.
        weights, ids = softmax_topk(self.router(x), self.top_k, renormalize=True)
        return all_reduce(self.experts(x, weights, ids))


_EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight",
                   "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}


class GptOssForCausalLM(DecoderForCausalLM):
    # Decode CUDA graphs capture it: on a GPU its experts (biases, clamped SwiGLU) run the Triton
    # grouped GEMM and attention its sinks and windows in the decode kernel, nothing read on the
    # host (tests/layers/test_moe_capture.py).
    cuda_graph_safe = True

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        window = cfg.sliding_windows[index] if index < len(cfg.sliding_windows) else None

        def attention(cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                      prefix: str) -> nn.Module:
            return SelfAttention(cfg, backend, quant, prefix, window, sinks=True)

        return DecoderLayer(cfg, backend, quant, prefix, index, self.make_mlp, attention)

    def make_mlp(self, cfg: ModelConfig, index: int, quant: QuantizationConfig | None, prefix: str) -> nn.Module:
        return GptOssMoE(cfg)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        head, sep, leaf = name.rpartition(".experts.")
        if sep and leaf in _EXPERT_TENSORS:
            return f"{head}.experts.{_EXPERT_TENSORS[leaf]}", None
        return None
