"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as one implementation with config
flags: q/k/v bias, q/k RMSNorm, tied embeddings, RoPE scaling, explicit head_dim.

The model has no parallelism code of its own: it is built from tensor-parallel layer types,
whose sizes shrink to this rank's slice when more than one rank runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import get_pp, get_pp_indices
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.attention.context import get_attention_metadata
from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.layers.quantization import QuantizationConfig, get_quantization_config
from pagoda.layers.norm_rope_act import RMSNorm, RotaryEmbedding, SiluAndMul

if TYPE_CHECKING:  # the fused blocks import this module, not the other way round
    from pagoda.models import cpu_decode


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None = None,
                 prefix: str = "", sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # keys older than this many positions are not attended
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, cfg.dtype, quant, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, cfg.dtype,
                                        quant, f"{prefix}.o_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.backend = backend
        # Set by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Per-token-head scales beside an int8/fp8 cache (None for a float cache).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        meta = get_attention_metadata()
        extra: dict = {}  # only what this layer uses, so simpler backends keep working
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.k_scale is not None:
            extra.update(k_scale=self.k_scale, v_scale=self.v_scale)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, **extra)
        return self.o_proj(out.reshape(t, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = "",
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        i = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], False, cfg.dtype, quant,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, cfg.dtype, quant, f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


# Builds layer ``index``'s MLP (dense or mixture of experts): (cfg, index, quant, prefix).
MakeMLP = Callable[[ModelConfig, int, "QuantizationConfig | None", str], nn.Module]
# Builds a layer's attention other than ``SelfAttention`` (MLA): (cfg, backend, quant, prefix).
MakeAttention = Callable[[ModelConfig, AttentionBackend, "QuantizationConfig | None", str], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None = None,
                 prefix: str = "", index: int = 0, make_mlp: MakeMLP | None = None,
                 make_attention: MakeAttention | None = None) -> None:
        super().__init__()
        window = cfg.sliding_windows[index] if index < len(cfg.sliding_windows) else None
        self.self_attn = (make_attention(cfg, backend, quant, f"{prefix}.self_attn") if make_attention is not None
                          else SelfAttention(cfg, backend, quant, f"{prefix}.self_attn", window))
        self.mlp = (make_mlp(cfg, index, quant, f"{prefix}.mlp") if make_mlp is not None
                    else MLP(cfg, quant, f"{prefix}.mlp"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        # The layer as two C++ calls for few-row CPU decode steps (``cpu_decode.attach``).
        self.cpu_decode: cpu_decode.FusedDecodeLayer | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        fused = self.cpu_decode
        if fused is not None and fused.serves(self):
            meta = get_attention_metadata()
            if fused.applies(meta, x, positions):
                return fused(positions, x, residual, meta)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MissingLayer(nn.Module):
    """A place held for a module another pipeline stage owns (no parameters, never called)."""


# What one pipeline stage hands the next: the hidden states and the residual stream.
StageTensors = tuple[torch.Tensor, torch.Tensor]


class DecoderModel(nn.Module):
    """Under pipeline parallelism this rank builds only its stage's layers (``start..end``),
    the embedding on the first stage and the final norm on the last; the other layers are
    ``MissingLayer``s, so layer ``i`` keeps its index and checkpoint names."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None = None,
                 prefix: str = "model", make_mlp: MakeMLP | None = None,
                 make_attention: MakeAttention | None = None, build_embedding: bool = True) -> None:
        super().__init__()
        pp = get_pp()
        self.start, self.end = get_pp_indices(cfg.num_layers, pp.rank, pp.size)
        self.is_first, self.is_last = pp.is_first, pp.is_last
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
                             if build_embedding else MissingLayer())
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, quant, f"{prefix}.layers.{i}", i, make_mlp,
                                                 make_attention) if self.start <= i < self.end else MissingLayer()
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype) if self.is_last else MissingLayer()
        # This stage's layers as a plain tuple: slicing the ModuleList would build a new one per step.
        self.stage_layers = tuple(self.layers[self.start:self.end])
        # All of them as one C++ call for few-row CPU decode steps (``cpu_decode.attach``).
        self.cpu_decode_stack: cpu_decode.FusedDecodeStack | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageTensors | None = None) -> torch.Tensor | StageTensors:
        """The first stage embeds ``input_ids``; later stages continue from the previous stage's
        ``intermediate``. The last stage returns the normed hidden states, the others
        ``(hidden, residual)`` for the next stage."""
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        stack = self.cpu_decode_stack
        if stack is not None and stack.serves() and stack.applies(meta := get_attention_metadata(), x, positions):
            x, residual = stack(positions, x, residual, meta)
            if stack.final_norm:  # the last stage's norm ran with the layers
                return x
        else:
            for layer in self.stage_layers:
                x, residual = layer(positions, x, residual)
        if not self.is_last:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    """Checkpoint names map onto these modules; fused projections are filled shard by shard."""

    # checkpoint module name -> (pagoda parameter's module, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.quant_config = get_quantization_config(cfg)
        pp = get_pp()  # a tied LM head is the embedding: the last stage holds it as that
        self.model = DecoderModel(cfg, backend, self.quant_config, make_mlp=self.make_mlp,
                                  make_attention=self.make_attention,
                                  build_embedding=pp.is_first or (pp.is_last and cfg.tie_word_embeddings))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype) if pp.is_last else MissingLayer()
        if cfg.tie_word_embeddings and pp.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True
        head_method = self.quant_config.get_lm_head_method() if self.quant_config is not None else None
        if head_method is not None and pp.is_last:
            self.lm_head.quantize_with(head_method)

    # Layer MLPs other than the dense one (mixture-of-experts models set this).
    make_mlp: MakeMLP | None = None
    make_attention: MakeAttention | None = None  # likewise for attention (MLA)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageTensors | None = None) -> torch.Tensor | StageTensors:
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[SelfAttention]:
        """This stage's attention layers (all of them without pipeline parallelism)."""
        return [layer.self_attn for layer in self.model.layers[self.model.start:self.model.end]]

    def stage_missing_prefixes(self) -> tuple[str, ...]:
        """Checkpoint name prefixes of the modules other pipeline stages own (skipped by the
        loader)."""
        model = self.model
        missing = [f"model.layers.{i}." for i in range(len(model.layers)) if not model.start <= i < model.end]
        for name, module in (("model.embed_tokens.", model.embed_tokens), ("model.norm.", model.norm),
                             ("lm_head.", self.lm_head)):
            if isinstance(module, MissingLayer):
                missing.append(name)
        return tuple(missing)
