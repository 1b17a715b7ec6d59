"""Dense families that are the shared decoder with a few of its options set:

- Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's layer; the checkpoint stores ``qkv_proj`` and
  ``gate_up_proj`` fused (loaded part by part, so tensor parallelism still slices each part);
  LongRoPE and partial rotary come from the shared ``make_rotary``.
- OLMo 2 (``Olmo2ForCausalLM``): norms only on the outputs of attention and the MLP, and q/k
  RMSNorms over the whole projection (all heads together) before the heads are split
  (``SpanRMSNorm``: under tensor parallelism the ranks' sums of squares are all-reduced).
- GLM-4 (``Glm4ForCausalLM``): four norms per layer, fused ``gate_up_proj``, q/k/v biases and
  partial rotary over interleaved pairs.
"""
from __future__ import annotations

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import all_reduce, get_tp
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.norm_rope_act import InterleavedRotaryEmbedding, RMSNorm
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import MLP, DecoderForCausalLM, LayerNorms, SandwichDecoderLayer, SelfAttention, make_rotary


class Phi3ForCausalLM(DecoderForCausalLM):
    # The checkpoint's projections are already fused under pagoda's names: nothing to pack.
    packed_modules: dict = {}


class SpanRMSNorm(nn.Module):
    """RMSNorm over a vector that tensor parallelism splits across ranks (OLMo 2's q and k
    projections): this rank holds elements ``[start, start + size)`` of the ``full``-long vector
    and their scales; the sum of squares is all-reduced. ``replicas``: how many ranks hold each
    element (K/V heads replicated when there are fewer than ranks), whose copies the sum counts
    that many times."""

    def __init__(self, full: int, start: int, size: int, replicas: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.full, self.start, self.replicas, self.eps = full, start, replicas, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, source: object, shard: object = None) -> None:
        param.data.copy_(source[self.start:self.start + param.shape[0]])  # type: ignore[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = all_reduce(x32.pow(2).sum(-1, keepdim=True))
        if self.replicas > 1:
            squares = squares / self.replicas
        return (x32 * torch.rsqrt(squares / self.full + self.eps) * self.weight.float()).to(x.dtype)


class Olmo2Attention(SelfAttention):
    """Attention whose q and k are RMS-normed across all heads at once (``q_norm`` over
    ``num_heads * head_dim``, ``k_norm`` over ``num_kv_heads * head_dim``), before the heads are
    split; under tensor parallelism each rank norms its heads with the ranks' summed squares."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                 prefix: str, sliding_window: int | None = None) -> None:
        super().__init__(cfg, backend, quant, prefix, sliding_window)
        rank, qkv, eps = get_tp().rank, self.qkv_proj, cfg.rms_norm_eps
        q, kv = qkv.q_size, qkv.kv_size
        self.q_norm = SpanRMSNorm(cfg.num_heads * cfg.head_dim, rank * q, q, 1, eps, cfg.dtype)
        self.k_norm = SpanRMSNorm(cfg.num_kv_heads * cfg.head_dim, rank // qkv.kv_replicas * kv, kv,
                                  qkv.kv_replicas, eps, cfg.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        return (q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))


def _dense_mlp(cfg: ModelConfig, index: int, quant: QuantizationConfig | None, prefix: str) -> nn.Module:
    return MLP(cfg, quant, prefix)


class Olmo2ForCausalLM(DecoderForCausalLM):
    _norms = LayerNorms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        window = cfg.sliding_windows[index] if index < len(cfg.sliding_windows) else None

        def attention(cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                      prefix: str) -> nn.Module:
            return Olmo2Attention(cfg, backend, quant, prefix, window)

        return SandwichDecoderLayer(cfg, backend, quant, prefix, index, self._norms, attention, _dense_mlp, RMSNorm)


class Glm4ForCausalLM(DecoderForCausalLM):
    # q/k/v are separate in the checkpoint; gate and up come fused under pagoda's name.
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    _norms = LayerNorms("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                        "post_mlp_layernorm")

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                   prefix: str, index: int) -> nn.Module:
        window = cfg.sliding_windows[index] if index < len(cfg.sliding_windows) else None

        def attention(cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                      prefix: str) -> nn.Module:
            return SelfAttention(cfg, backend, quant, prefix, window,
                                 rotary=make_rotary(cfg, cls=InterleavedRotaryEmbedding))

        return SandwichDecoderLayer(cfg, backend, quant, prefix, index, self._norms, attention, _dense_mlp, RMSNorm)
