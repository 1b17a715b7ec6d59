"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Per token the cache holds only ``c = [kv_a_layernorm(c_kv) | rope(k_pe)]``: ``kv_lora_rank``
latent values and ``qk_rope_head_dim`` rotary key values, one "head" of that width, with no
separate V plane. Attention runs in the latent space with absorbed projections: with
``kv_b_proj`` split per head into ``W_UK [nope, kv_lora]`` and ``W_UV [v, kv_lora]``,

    score(q, c) = q_nope . (W_UK c_kv) + q_pe . k_pe = [q_nope W_UK | q_pe] . c
    out         = W_UV (sum_j p_j c_kv_j)

so every head attends to the one shared latent "key" ``c`` with the query ``[q_nope W_UK |
q_pe]`` and reads back the value ``c_kv`` (the first ``kv_lora_rank`` columns of the same cache
row). That is multi-query attention with K = V = the cache: a backend with ``forward_latent``
(Triton, whose decode kernel reads each cache row once, ``triton_mla.py``) takes it as latent
attention; any other gets it through ``forward`` (torch with the C++ decode kernel on CPU) with
``k_cache`` and ``v_cache`` both the latent cache, and the layer keeps the first
``kv_lora_rank`` output columns. Prefill,
chunked prefill, prefix-cache hits and decode are all the same computation; nothing about the
scheduler or the block pool changes.
"""
from __future__ import annotations

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.attention.context import get_attention_metadata
from pagoda.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from pagoda.layers.norm_rope_act import RMSNorm, RotaryEmbedding, yarn_mscale
from pagoda.distributed.parallel_state import get_tp

# DeepSeek's q_a/kv_a layernorms use this epsilon whatever the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


class _UnpackedColumnParallel(ColumnParallelLinear):
    """``kv_b_proj``: its weight is read per head for the absorbed projections, so it stays a
    dense tensor (never repacked for oneDNN)."""

    def pack_weight(self) -> bool:
        return False


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    hf = cfg.hf_config
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V3 attention; the KV cache layout it asks for is ``kv_planes = 1`` plane of
    ``num_kv_heads = 1`` head of ``kv_head_dim = kv_lora_rank + qk_rope_head_dim``."""

    kv_planes = 1
    num_kv_heads = 1

    @property
    def decode_programs(self) -> int:
        """Programs a sequence's decode attention spreads over before any split (the latent
        kernel's head tiles, not the one KV head): what a decode graph pins its splits from."""
        from pagoda.layers.attention.triton_mla import mla_head_blocks

        return mla_head_blocks(self.num_heads)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: object = None, prefix: str = "") -> None:
        super().__init__()
        hf = cfg.hf_config
        self.nope, self.rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_dim, self.kv_lora = hf["v_head_dim"], hf["kv_lora_rank"]
        self.num_heads = divide(cfg.num_heads, get_tp().size)
        self.kv_head_dim = self.kv_lora + self.rope
        self.interleaved = bool(hf.get("rope_interleave", True))
        bias, h, qk = bool(hf.get("attention_bias", False)), cfg.hidden_size, self.nope + self.rope
        q_lora = hf.get("q_lora_rank")
        if q_lora:
            self.q_a_proj = ReplicatedLinear(h, q_lora, bias, cfg.dtype)
            self.q_a_layernorm = RMSNorm(q_lora, _LATENT_NORM_EPS, cfg.dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora, cfg.num_heads * qk, False, cfg.dtype)
        else:
            self.q_proj = ColumnParallelLinear(h, cfg.num_heads * qk, False, cfg.dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_head_dim, bias, cfg.dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, _LATENT_NORM_EPS, cfg.dtype)
        self.kv_b_proj = _UnpackedColumnParallel(self.kv_lora, cfg.num_heads * (self.nope + self.v_dim), False,
                                                 cfg.dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, h, bias, cfg.dtype)
        self.rotary = RotaryEmbedding(self.rope, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.dtype)
        self.scale = mla_softmax_scale(cfg)
        self.backend = backend
        # Set by the model runner once the KV cache is allocated (both views of the latent cache).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Scales of an int8/fp8 cache (one per token: the latent row is the one "head").
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        # Interleaved checkpoints rotate pairs (x0, x1), (x2, x3), ...: reordering to evens then
        # odds turns that into the rotate-half form (the same permutation on q and k keeps every
        # dot product).
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self._queries(x)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary(positions, self._deinterleave(q_pe).contiguous(),
                                 self._deinterleave(k_pe).reshape(t, 1, self.rope).contiguous())
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora]
        query = torch.cat([q_latent, q_pe], dim=-1)
        latent = torch.cat([c_kv, k_pe.reshape(t, self.rope)], dim=-1).reshape(t, 1, self.kv_head_dim)
        meta = get_attention_metadata()
        if hasattr(self.backend, "forward_latent"):
            out = self.backend.forward_latent(query, latent, self.k_cache, meta, self.scale, self.kv_lora,
                                              cache_scale=self.k_scale)
        else:
            scales = {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}
            out = self.backend.forward(query, latent, latent, self.k_cache, self.v_cache, meta, self.scale, **scales)
        o_latent = out[..., :self.kv_lora].transpose(0, 1)  # [H, T, kv_lora]
        o = torch.bmm(o_latent, w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))
