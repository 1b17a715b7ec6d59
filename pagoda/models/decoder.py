"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) as one implementation with
config flags: q/k/v bias, q/k RMSNorm, tied embeddings, RoPE scaling (LongRoPE included), partial
rotary, explicit head_dim.

Other families reuse it through small named options, each set by the family's model class
(``pagoda/models/gemma.py``, ``families.py``): the attention's own ``rotary``, ``scale``,
``softcap`` and q/k ``norm`` class; ``SandwichDecoderLayer`` for norms after attention and the
MLP (``LayerNorms`` names them); ``make_norm`` for every norm of the model; ``embed_scale`` for
a multiplier on the token embeddings.

The model has no parallelism code of its own: it is built from tensor-parallel layer types,
whose sizes shrink to this rank's slice when more than one rank runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.distributed.parallel_state import get_pp, get_pp_indices, get_tp
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.attention.context import current_abandon, get_attention_metadata
from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.layers.fused_ops import use_triton
from pagoda.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 RowParallelLinear)
from pagoda.layers.quantization import QuantizationConfig, get_quantization_config
from pagoda.layers.norm_rope_act import MRotaryEmbedding, RMSNorm, RotaryEmbedding, SiluAndMul, resolve_longrope
from pagoda.step import StepAbandoned

# Builds a norm: (hidden size, eps, dtype).
MakeNorm = Callable[[int, float, torch.dtype], nn.Module]


def rotary_dim(cfg: ModelConfig) -> int:
    """How many of a head's dims rotate (``partial_rotary_factor``, at the top of config.json or
    in its ``rope_parameters``); the rest pass through."""
    hf = cfg.hf_config
    factor = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
    return int(cfg.head_dim * float(factor)) if factor else cfg.head_dim


def make_rotary(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None,
                cls: type[RotaryEmbedding] = RotaryEmbedding) -> RotaryEmbedding:
    """The rotary embedding of the config (or of ``theta``/``scaling``: a layer type's own),
    over ``rotary_dim(cfg)`` dims, with LongRoPE's factors fixed for this ``max_model_len``."""
    scaling = cfg.rope_scaling if scaling is None and theta is None else scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        original = (scaling.get("original_max_position_embeddings")
                    or cfg.hf_config.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        scaling = resolve_longrope(scaling, cfg.max_position_embeddings, int(original), cfg.max_model_len)
    return cls(rotary_dim(cfg), cfg.max_position_embeddings, cfg.rope_theta if theta is None else theta,
               scaling, cfg.dtype)

if TYPE_CHECKING:  # the fused blocks import this module, not the other way round
    from pagoda.models import cpu_decode


class SelfAttention(nn.Module):
    """Grouped-query attention over the paged cache. Options (defaults are Llama's): ``rotary``
    (a layer's own rotary embedding), ``scale`` (of the scores; ``head_dim ** -0.5``),
    ``softcap`` (attention logit soft-capping; needs a backend that ``supports_softcap``),
    ``norm`` (the class of the q/k norms, when the config asks for them), ``sinks`` (a learned
    sink logit per head, checkpoint name ``sinks``; a backend that ``supports_sinks``) and
    ``chunk_size`` (chunked local attention; a backend that ``supports_chunked_attention``)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None = None,
                 prefix: str = "", sliding_window: int | None = None, *, rotary: nn.Module | None = None,
                 scale: float | None = None, softcap: float | None = None, norm: MakeNorm = RMSNorm,
                 sinks: bool = False, chunk_size: int | None = None) -> None:
        super().__init__()
        for used, flag, what in ((softcap is not None, "supports_softcap", "attention logit soft-capping"),
                                 (sinks, "supports_sinks", "attention sinks"),
                                 (chunk_size is not None, "supports_chunked_attention", "chunked local attention")):
            if used and not getattr(backend, flag, False):
                raise ValueError(f"{cfg.architecture} uses {what}, which the {type(backend).__name__} attention "
                                 f"backend does not implement (a backend with {flag} does)")
        self.softcap = softcap
        self.sliding_window = sliding_window  # keys older than this many positions are not attended
        self.chunk_size = chunk_size  # keys before the query's chunk of this many positions are not attended
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, cfg.dtype, quant, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, cfg.dtype,
                                        quant, f"{prefix}.o_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5 if scale is None else scale
        self.rotary = rotary if rotary is not None else make_rotary(cfg)
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        # float32 whatever the model dtype: they join float32 scores. This rank's heads only.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if sinks else None
        if self.sinks is not None:
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self.backend = backend
        # Norms, rotary and the KV write as one launch (``triton_qkv.py``) where the backend
        # takes K/V already written and this class's own projection and NeoX rotary run.
        self.fused_prepare = (type(self.rotary) in (RotaryEmbedding, MRotaryEmbedding)
                              and (self.q_norm is None or isinstance(self.q_norm, RMSNorm))
                              and type(self).project is SelfAttention.project
                              and os.environ.get("PAGODA_FUSED_QKV", "1") != "0")
        # Set by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Per-token-head scales beside an int8/fp8 cache (None for a float cache).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def _load_sinks(self, param: nn.Parameter, source: object, shard: object = None) -> None:
        start = get_tp().rank * self.num_heads
        param.data.copy_(source[start:start + self.num_heads])  # type: ignore[index]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k and v ``[T, Hkv, D]`` of ``x``, q and k normed (before rotary)."""
        return self.split_heads(self.qkv_proj(x))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project``'s heads of the projection ``qkv`` ``[T, (H + 2 Hkv) D]``."""
        t = qkv.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    @property
    def takes_projection(self) -> bool:
        """Whether ``forward_projected`` stands for ``forward`` (a family's own ``forward`` or
        ``project`` makes its own projection)."""
        return type(self).forward is SelfAttention.forward and type(self).project is SelfAttention.project

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if type(self).project is SelfAttention.project:
            return self.forward_projected(positions, self.qkv_proj(x))
        q, k, v = self.project(x)
        q, k = self.rotary(positions, q, k)
        return self.attend(q, k, v)

    def forward_projected(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """``forward`` from ``qkv = qkv_proj(x)`` made already (where ``takes_projection``)."""
        if (self.fused_prepare and getattr(self.backend, "fuses_kv_write", False) and positions.dim() == 1
                and use_triton(qkv) and self.k_cache.numel() > 0):
            return self.attend(*self.prepare(positions, qkv), kv_written=True)
        q, k, v = self.split_heads(qkv)
        q, k = self.rotary(positions, q, k)
        return self.attend(q, k, v)

    def prepare(self, positions: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``split_heads`` and ``rotary`` of the projection ``qkv`` with k and v written into the
        cache, in one launch."""
        from pagoda.layers.attention.triton_qkv import prepare_qkv

        qn, kn = self.q_norm, self.k_norm
        return prepare_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions,
                           self.rotary.cos_sin_cache, qn.weight if qn is not None else None,
                           kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0,
                           self.k_cache, self.v_cache, get_attention_metadata().slot_mapping, self.k_scale,
                           self.v_scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """The paged attention of the (rotated) q, k, v through the output projection;
        ``kv_written``: k and v are in the cache already (``prepare``)."""
        meta = get_attention_metadata()
        extra: dict = {}  # only what this layer uses, so simpler backends keep working
        if kv_written:
            extra["kv_written"] = True
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.k_scale is not None:
            extra.update(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        if self.chunk_size is not None:
            extra["attention_chunk_size"] = self.chunk_size
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, **extra)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


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
        return self.forward_projected(self.gate_up_proj(x))

    def forward_projected(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``forward`` from ``gate_up = gate_up_proj(x)`` made already."""
        if type(self.act) is SiluAndMul and type(self.down_proj) is RowParallelLinear:
            # A few rows on the GPU: the activation may ride in the down projection's loads.
            y = self.down_proj.forward_silu_mul(gate_up)
            if y is not None:
                return y
        return self.down_proj(self.act(gate_up))


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
        # Whether each norm may ride in the projection after it (``_fold``): the attention and
        # the MLP take their projections made (not a family's own projection).
        self.fold_attention = isinstance(self.self_attn, SelfAttention) and self.self_attn.takes_projection
        self.fold_mlp = isinstance(self.mlp, MLP) and type(self.mlp).forward is MLP.forward

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        fused = self.cpu_decode
        if fused is not None and fused.serves(self):
            meta = get_attention_metadata()
            if fused.applies(meta, x, positions):
                return fused(positions, x, residual, meta)
        folded = self._fold(self.input_layernorm, self.self_attn.qkv_proj, x, residual) if self.fold_attention else None
        if folded is not None:
            qkv, residual = folded
            x = self.self_attn.forward_projected(positions, qkv)
        else:
            if residual is None:
                residual, x = x, self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(positions, x)
        folded = (self._fold(self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual) if self.fold_mlp
                  else None)
        if folded is not None:
            gate_up, residual = folded
            return self.mlp.forward_projected(gate_up), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    @staticmethod
    def _fold(norm: RMSNorm, proj: nn.Module, x: torch.Tensor,
              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(proj(norm(x, residual)), residual stream)`` with the norm in the projection's loads
        (``ColumnParallelLinear.forward_normed``: one row on the GPU), or None: the caller runs
        them apart (also for a LoRA wrapper, whose delta reads the normed rows)."""
        if not isinstance(proj, ColumnParallelLinear) or type(norm).forward is not RMSNorm.forward:
            return None  # (a norm of another formula is not the kernel's)
        return proj.forward_normed(x, residual, norm.weight, norm.eps)


@dataclass(frozen=True)
class LayerNorms:
    """A ``SandwichDecoderLayer``'s norms by their checkpoint names, None where a family has
    none: before attention, after it (on its output), before the MLP, after it."""

    pre_attn: str | None
    post_attn: str | None
    pre_mlp: str | None
    post_mlp: str | None


class SandwichDecoderLayer(nn.Module):
    """A decoder layer with norms on the outputs of attention and the MLP as well as (or instead
    of) on their inputs: Gemma 2/3 (all four), OLMo 2 (only the output norms), GLM-4 (all four,
    named differently). Same ``(delta, residual)`` interface as ``DecoderLayer``; never served by
    the fused CPU decode blocks, which know only the pre-norm layer."""

    cpu_decode = None  # see DecoderLayer; read by ``cpu_decode.attach`` for a model's stack

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None, prefix: str,
                 index: int, norms: LayerNorms, make_attention: MakeAttention, make_mlp: MakeMLP,
                 make_norm: MakeNorm) -> None:
        super().__init__()
        self.self_attn = make_attention(cfg, backend, quant, f"{prefix}.self_attn")
        self.mlp = make_mlp(cfg, index, quant, f"{prefix}.mlp")
        self.norms = norms
        for name in (norms.pre_attn, norms.post_attn, norms.pre_mlp, norms.post_mlp):
            if name is not None:
                self.add_module(name, make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype))

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else self._modules[name](x)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        h = x if residual is None else x + residual  # the residual stream entering this layer
        n = self.norms
        h = h + self._norm(n.post_attn, self.self_attn(positions, self._norm(n.pre_attn, h)))
        return self._norm(n.post_mlp, self.mlp(self._norm(n.pre_mlp, h))), h


# Builds layer ``index`` of a model: (cfg, backend, quant, prefix, index).
MakeLayer = Callable[[ModelConfig, AttentionBackend, "QuantizationConfig | None", str, int], nn.Module]


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
                 make_attention: MakeAttention | None = None, build_embedding: bool = True,
                 make_layer: MakeLayer | None = None, make_norm: MakeNorm = RMSNorm) -> None:
        super().__init__()
        pp = get_pp()
        self.start, self.end = get_pp_indices(cfg.num_layers, pp.rank, pp.size)
        self.is_first, self.is_last = pp.is_first, pp.is_last
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
                             if build_embedding else MissingLayer())

        def layer(i: int) -> nn.Module:
            if make_layer is not None:
                return make_layer(cfg, backend, quant, f"{prefix}.layers.{i}", i)
            return DecoderLayer(cfg, backend, quant, f"{prefix}.layers.{i}", i, make_mlp, make_attention)

        self.layers = nn.ModuleList(layer(i) if self.start <= i < self.end else MissingLayer()
                                    for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype) if self.is_last else MissingLayer()
        # This stage's layers as a plain tuple: slicing the ModuleList would build a new one per step.
        self.stage_layers = tuple(self.layers[self.start:self.end])
        # All of them as one C++ call for few-row CPU decode steps (``cpu_decode.attach``).
        self.cpu_decode_stack: cpu_decode.FusedDecodeStack | None = None

    # A multiplier on the token embeddings (Gemma: sqrt(hidden_size)), None for none.
    embed_scale: float | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: StageTensors | None = None) -> torch.Tensor | StageTensors:
        """The first stage embeds ``input_ids``; later stages continue from the previous stage's
        ``intermediate``. The last stage returns the normed hidden states, the others
        ``(hidden, residual)`` for the next stage."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                x = x * self.embed_scale
        else:
            x, residual = intermediate
        stack = self.cpu_decode_stack
        if stack is not None and stack.serves() and stack.applies(meta := get_attention_metadata(), x, positions):
            x, residual = stack(positions, x, residual, meta)
            if stack.final_norm:  # the last stage's norm ran with the layers
                return x
        else:
            abandon = current_abandon()
            for layer in self.stage_layers:
                if abandon is not None and abandon():  # a background-only step: interactive work came
                    raise StepAbandoned()
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
                                  build_embedding=pp.is_first or (pp.is_last and cfg.tie_word_embeddings),
                                  make_layer=self.make_layer, make_norm=self.make_norm)
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
    make_layer: MakeLayer | None = None  # whole layers other than ``DecoderLayer`` (sandwich norms)
    make_norm: MakeNorm = RMSNorm  # the class of every norm the model builds itself

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
