"""Whole decoder-layer blocks in one C++ call each, for the decode steps on CPU.

Why: a batch-1 decode step of a small model is a few milliseconds of weight streaming, and
around it every layer made about thirty small calls from Python (norms, the projections'
split and reshapes, rotary, the cache write and its checks, the paged-attention call and the
indexing around it, SiLU-and-mul...). Each costs microseconds on its own, and several times
that inside a real step: the step streams the weights through every cache level, so the
interpreter's and the dispatcher's code and data are cold at each call. Measured on the
2-core development machine, those calls took about as long as the layers' matrices at batch 1,
and a quarter of a batch-8 step.

Here each layer is two calls while a step is all decodes (one token per sequence) of at most
``MAX_ROWS`` sequences:

- ``attn_block``: residual add + RMSNorm, the fused q/k/v projection (+ bias), q/k RMSNorm
  (Qwen3), rotary, the K/V written into the paged cache, paged decode attention (sliding
  window included) and the output projection;
- ``mlp_block``: residual add + RMSNorm, gate/up projection, SiLU-and-mul, down projection
  (dense MLPs; a mixture-of-experts layer runs its own MLP after the fused attention block).

The blocks are pagoda/kernels/csrc/decode.cpp, linked with the other kernels in one library, so
the arithmetic is theirs (the gemv loop, paged attention, the norm and SiLU ops), and the products
go to the kernel the layer itself would use: the AMX tile kernel or the panels for as many rows
as the layer chose them for, the gemv loop for up to four rows where the layer kept its dense
weight, oneDNN over the weight ``cpu_gemm`` packed (through the dispatcher) otherwise, and the
int8 (per channel or in groups: GGUF Q8_0) / int4 / fp8 kernel (pagoda/kernels/woq.py) for
weights quantized for it. This module decides,
from the model's modules, which layers qualify; what a layer needs is checked
once, when the KV cache is attached (``attach``): float32 or bfloat16 weights of those kinds (no
LoRA wrapper, no act-order permutation), a float32 or bfloat16 KV cache, one tensor-parallel rank, NeoX-style
rotary with one-dimensional positions. Every other layer, and every step with a prefill chunk,
draft rows or more than ``MAX_ROWS`` sequences, runs the module code as before.
``PAGODA_CPU_FUSED_DECODE=0`` (or ``PAGODA_CPU_KERNELS=0``) turns it off.
"""
from __future__ import annotations

import logging
import os
import weakref

import torch
from torch import nn

from pagoda.kernels import select, woq
from pagoda.kernels.build import Kernel
from pagoda.step import StepAbandoned

logger = logging.getLogger(__name__)

ENV_VAR = select.FUSED_DECODE_VAR
# Decode steps of more sequences spend little of their time in the per-call overheads the blocks save.
MAX_ROWS = 64


_KERNEL = Kernel("decode", "CPU fused decode-layer kernel", "decode layers run op by op",
                 supported=select.fused_decode_enabled)

_EMPTY = torch.empty(0)
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)


def load() -> object | None:
    """The kernel library's op namespace, or None when the blocks cannot run here (or are
    switched off)."""
    return _KERNEL.load()


DENSE = -1  # the kind of a dense float weight (cpu_woq's kinds are >= 0)
# The model dtypes the blocks serve: float32, and bfloat16 (bfloat16 weights and KV cache; the
# blocks compute in float32 and hand bfloat16 rows back to the module path).
_DTYPES = (torch.float32, torch.bfloat16)


def _linear_spec(linear: nn.Module) -> tuple[list[torch.Tensor], int, int] | None:
    """How the C++ blocks multiply by ``linear``: (its eight tensors, kind, group size; for a dense
    weight with tiles (``cpu_amx``'s or ``cpu_panel``'s), its output size + the tiles' row limit
    << 32 in place of the group size), or None where they cannot. Qualify: a plain (unquantized, unwrapped) float32
    weight, dense for the gemv kernel and/or packed for oneDNN, and a weight quantized for
    ``cpu_woq`` (no input permutation); not a LoRA wrapper, another quantized kernel or a
    tensor-parallel shard."""
    from pagoda.layers.linear import LinearBase
    from pagoda.layers.quantization.base import UnquantizedLinearMethod

    if not isinstance(linear, LinearBase) or getattr(linear, "tp_size", 1) != 1:
        return None
    bias = _vector(linear.bias)
    if type(linear.quant_method) is UnquantizedLinearMethod:
        weight, packed = linear.weight, getattr(linear, "packed", None)
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        # The dense copy stays where the gemv kernel serves few rows; oneDNN's packed one serves
        # the rest (both, one or the other; a layer with neither cannot be fused).
        dense = weight.data if weight.numel() > 0 and weight.dim() == 2 and weight.is_contiguous() else _EMPTY
        tiles = getattr(packed, "pagoda_tiles", None)
        out = packed.pagoda_out + (packed.pagoda_tiles_rows << 32) if tiles is not None else 0
        packed = packed if packed is not None else _EMPTY
        if not dense.numel() and not packed.numel():
            return None
        return [dense, _EMPTY, _EMPTY, _EMPTY, _EMPTY_I32, bias, packed, _EMPTY if tiles is None else tiles], DENSE, out
    q = getattr(linear, "qlinear", None)
    if _on_kernel(q):
        return _woq_tensors(q, bias), q.kind, q.group_size
    return None


def _on_kernel(q: object) -> bool:
    return type(q) is woq.WoqCPU and q.perm is None and q.ops is not None  # type: ignore[attr-defined]


def _woq_tensors(q: woq.WoqCPU, bias: torch.Tensor) -> list[torch.Tensor]:
    """A weight-only quantized linear's eight tensors, as the blocks' ``Linear`` reads them."""
    return [q.packed, q.col_scale, q.group_scale, q.group_bias, q.aux, bias, _EMPTY, _EMPTY]


def _vector(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t.data.float().contiguous()


class FusedDecodeLayer:
    """One decoder layer's fused blocks: their arguments registered with the kernel library
    (``attn`` / ``mlp`` are the integer handles of ``decode_register_*``; ``mlp`` None: the layer's
    MLP is not a dense one, or its weights do not qualify, and it runs as a module), released when
    this object goes."""

    @staticmethod
    def applies(meta, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Module-level ``applies``, asked through the blocks (the decoder does not import this
        module: this module builds on the decoder)."""
        return applies(meta, x, positions)

    def __init__(self, layer: nn.Module, attn: tuple, mlp: tuple | None) -> None:
        self.layer = layer
        self.backend = layer.self_attn.backend  # the blocks stand in for this backend only
        self.module = load()
        self.attn = self.module.decode_register_attn(*attn)  # type: ignore[union-attr]
        self.mlp = None if mlp is None else self.module.decode_register_mlp(*mlp)  # type: ignore[union-attr]
        for handle in (self.attn, self.mlp):
            if handle is not None:
                weakref.finalize(self, self.module.decode_release, handle)  # type: ignore[union-attr]

    def serves(self, layer: nn.Module) -> bool:
        """Whether the blocks still stand for ``layer`` (a test or tool may swap its attention
        backend for another, which must then run). Read through ``_modules``: a step checks
        every layer, and ``nn.Module.__getattr__`` costs microseconds a call when cold."""
        attn = layer._modules.get("self_attn")
        return attn is not None and attn.backend is self.backend

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta):
        # The blocks take (contiguous copies of) the views a previous layer's module path may hand
        # over, and a bfloat16 model's rows, computing in float32; the MLP block hands the model's
        # dtype back.
        dtype = x.dtype
        out, residual = self.module.decode_attn_block(  # type: ignore[union-attr]
            self.attn, x, residual, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        if self.mlp is None:
            x, residual = self.layer.post_attention_layernorm(out.to(dtype), residual.to(dtype))
            return self.layer.mlp(x), residual
        return self.module.decode_mlp_block(self.mlp, out, residual, dtype == torch.bfloat16)  # type: ignore[union-attr]


class FusedDecodeStack:
    """A pipeline stage's decoder layers when every one has both fused blocks: a decode step
    runs them all in one C++ call (``layers``) instead of two per layer, and the last stage's
    final RMSNorm with them (``final_norm``; a bfloat16 model's norm as torch ops was about ten
    cold calls per step)."""

    @staticmethod
    def applies(meta, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Module-level ``applies``, asked through the blocks (the decoder does not import this
        module: this module builds on the decoder)."""
        return applies(meta, x, positions)

    def __init__(self, layers: list[FusedDecodeLayer], final_norm: nn.Module | None = None) -> None:
        self.blocks = layers
        self.module = layers[0].module
        self.attn = [b.attn for b in layers]
        self.mlp = [b.mlp for b in layers]
        self.final_norm = final_norm is not None
        self.final_w = _vector(final_norm.weight) if final_norm is not None else None
        self.final_eps = float(final_norm.eps) if final_norm is not None else 0.0

    def serves(self) -> bool:
        """Whether every layer's blocks still stand for it (see ``FusedDecodeLayer.serves``)."""
        return all(b.layer.cpu_decode is b and b.serves(b.layer) for b in self.blocks)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta):
        if meta.abandon is not None:
            return self._abandonable(positions, x, residual, meta)
        return self.module.decode_layers(  # type: ignore[union-attr]
            self.attn, self.mlp, x, residual, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            x.dtype == torch.bfloat16, self.final_w, self.final_eps)

    def _abandonable(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta):
        """The same stack as one ``layers`` call per layer, asking ``meta.abandon`` before each
        (``StepAbandoned`` if it says so), for a background-only step: an interactive arrival
        then waits for one layer, not the whole step. Each call hands its rows on as the
        layer-by-layer blocks do, so the results are the one call's."""
        bf16 = x.dtype == torch.bfloat16
        last = len(self.attn) - 1
        for i in range(last + 1):
            if meta.abandon():
                raise StepAbandoned()
            final_w, final_eps = (self.final_w, self.final_eps) if i == last else (None, 0.0)
            x, residual = self.module.decode_layers(  # type: ignore[union-attr]
                self.attn[i:i + 1], self.mlp[i:i + 1], x, residual, positions,
                meta.slot_mapping, meta.block_tables, meta.seq_lens, bf16, final_w, final_eps)
        return x, residual


def build(layer: nn.Module) -> FusedDecodeLayer | None:
    """The fused blocks of a ``DecoderLayer`` whose attention qualifies (see the module
    docstring; its MLP joins when it qualifies too), else None."""
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.layers.norm_rope_act import MRotaryEmbedding, RMSNorm, RotaryEmbedding
    from pagoda.models.decoder import MLP, SelfAttention

    attn = getattr(layer, "self_attn", None)
    if type(attn) is not SelfAttention or type(attn.backend) is not TorchAttentionBackend or load() is None:
        return None
    if attn.softcap is not None or attn.sinks is not None or attn.chunk_size is not None:
        return None  # scores the C++ block does not compute (capped, with sinks, chunked)
    qkv, o = _linear_spec(attn.qkv_proj), _linear_spec(attn.o_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    rotary, k_cache, v_cache = attn.rotary, attn.k_cache, attn.v_cache
    eps = layer.input_layernorm.eps
    if (qkv is None or o is None or any(n is not None and (type(n) is not RMSNorm or n.eps != eps) for n in norms)
            or type(rotary) not in (RotaryEmbedding, MRotaryEmbedding) or rotary.cos_sin_cache.dtype not in _DTYPES
            or rotary.cos_sin_cache.shape[1] > attn.head_dim or attn.k_scale is not None
            or k_cache.dtype not in _DTYPES or k_cache.dim() != 4 or k_cache.stride(-1) != 1
            or k_cache.stride() != v_cache.stride()):
        return None
    tensors = [_vector(layer.input_layernorm.weight), _vector(attn.q_norm.weight if attn.q_norm else None),
               _vector(attn.k_norm.weight if attn.k_norm else None), rotary.cos_sin_cache.float().contiguous(),
               k_cache, v_cache]
    ints = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.sliding_window or 0, qkv[1], qkv[2], o[1], o[2]]
    attn_args = (tensors, qkv[0], o[0], ints, [float(eps), float(attn.scale)])
    mlp_args = None
    mlp = layer.mlp
    if type(mlp) is MLP:
        gate_up, down = _linear_spec(mlp.gate_up_proj), _linear_spec(mlp.down_proj)
        if gate_up is not None and down is not None:
            mlp_args = (_vector(layer.post_attention_layernorm.weight), gate_up[0], down[0],
                        [gate_up[1], gate_up[2], down[1], down[2]], float(eps))
    return FusedDecodeLayer(layer, attn_args, mlp_args)


def attach(model: nn.Module) -> int:
    """Give every qualifying decoder layer of ``model`` its fused blocks (after the KV cache is
    allocated: the blocks hold the layer's cache tensors). Returns how many layers qualified."""
    from pagoda.layers.norm_rope_act import RMSNorm
    from pagoda.models.decoder import DecoderLayer, DecoderModel

    count = 0
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            module.cpu_decode = build(module)
            count += module.cpu_decode is not None
    for module in model.modules():  # a stage whose layers all fused both blocks runs as one call
        if isinstance(module, DecoderModel) and module.stage_layers:
            blocks = [layer.cpu_decode for layer in module.stage_layers]
            full = all(b is not None and b.mlp is not None for b in blocks)
            norm = module.norm if module.is_last and type(module.norm) is RMSNorm else None
            module.cpu_decode_stack = FusedDecodeStack(blocks, norm) if full else None
    if count:
        logger.info("fused CPU decode blocks for %d layers", count)
    return count


def applies(meta, x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether this step runs the fused blocks: all decodes (one token per sequence), at most
    ``MAX_ROWS`` of them, float32 or bfloat16 rows, and the Triton kernels not forced onto CPU tensors
    (``PAGODA_FORCE_TRITON=1``, the tests of those kernels). Decided once per step (the layers
    share ``meta``)."""
    ok = getattr(meta, "_cpu_decode_ok", None)
    if ok is None:
        n = len(meta.query_lens_cpu)
        ok = (0 < n <= MAX_ROWS and meta.max_query_len == 1 and int(meta.slot_mapping.shape[0]) == n
              and os.environ.get("PAGODA_FORCE_TRITON") != "1"
              and positions.dim() == 1 and positions.dtype == torch.int64 and x.dtype in _DTYPES
              and x.dim() == 2)
        meta._cpu_decode_ok = ok
    return ok
