"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that takes the
checkpoint tensor (or a lazy safetensors slice) and copies in only this rank's part, so loading
a sharded model is one loop and no rank materialises the full weights."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.distributed.parallel_state import all_reduce, get_tp
from pagoda.layers import skinny_gemm
from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod, set_weight_attrs


def divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


def load_rows(source: Any, start: int, size: int) -> torch.Tensor:
    """Rows ``[start, start+size)`` of a tensor or a lazy safetensors slice (reads only those)."""
    return source[start:start + size]


def load_cols(source: Any, start: int, size: int) -> torch.Tensor:
    return source[:, start:start + size]


def full(source: Any) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return source
    return source[...] if not source.get_shape() else source[:]


def source_shape(source: Any) -> tuple[int, ...]:
    """The shape of a checkpoint tensor or lazy safetensors slice, without reading it."""
    return tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())


def check_extent(source: Any, dim: int, expected: int, exact: bool = True) -> None:
    """Refuse a checkpoint tensor whose extent along ``dim`` (all ranks' parts together) is not
    what the model's config gives: a config that disagrees with its weights would otherwise
    load them cut to size and generate garbage. (The loader names the tensor and parameter.)
    ``exact`` False: no check (a layout whose scales may be padded to whole blocks)."""
    shape = source_shape(source)
    if exact and (dim >= len(shape) or shape[dim] != expected):
        raise RuntimeError(f"the checkpoint tensor has shape {shape}; the model's config gives {expected} "
                           f"along dimension {dim}")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, exact: bool = True) -> None:
    """``dst.copy_(src)`` for tensors of one shape, or one element each (a scalar scale into a
    one-element parameter); any other pair is refused rather than broadcast (``exact`` False:
    ``copy_``'s own rules)."""
    if exact and tuple(src.shape) != tuple(dst.shape):
        if src.numel() != 1 or dst.numel() != 1:
            raise RuntimeError(f"the checkpoint tensor has shape {tuple(src.shape)}; the model's config gives "
                               f"{tuple(dst.shape)}")
        src = src.reshape(dst.shape)
    dst.copy_(src)


def load_along(source: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``[start, start+size)`` along ``dim`` of a tensor or a lazy safetensors slice."""
    return source[(slice(None),) * dim + (slice(start, start + size),)]


class FusedPart:
    """Elements ``[start, start + size)`` along ``dim`` of a checkpoint tensor or lazy safetensors
    slice, indexed like a tensor of their own: one projection of a checkpoint that stores
    several fused (Phi-3's ``qkv_proj``, GLM-4's and Phi-3's ``gate_up_proj``)."""

    def __init__(self, source: Any, dim: int, start: int, size: int) -> None:
        self.source, self.dim, self.start, self.size = source, dim, start, size

    def get_shape(self) -> list[int]:
        shape = list(self.source.shape if isinstance(self.source, torch.Tensor) else self.source.get_shape())
        shape[self.dim] = self.size
        return shape

    def __getitem__(self, key: Any) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (self.dim + 1 - len(key))
        part = key[self.dim]
        lo, hi = part.start or 0, self.size if part.stop is None else part.stop
        return self.source[key[:self.dim] + (slice(self.start + lo, self.start + hi),) + key[self.dim + 1:]]


def load_fused(layer: "ColumnParallelLinear", param: nn.Parameter, source: Any,
               parts: list[tuple[Any, int, int]]) -> None:
    """Load a checkpoint's fused projection into ``param`` part by part: ``parts`` lists each
    part's shard id, logical offset and size along the output features of the full tensor."""
    dim = getattr(param, "output_dim", None)
    if dim is None or getattr(param, "per_shard", False):
        raise ValueError(f"{layer.prefix}: a fused checkpoint tensor cannot fill this parameter "
                         "(its projections carry separate per-tensor values)")
    factor = _packed(param, dim)
    check_extent(source, dim, sum(size for _, _, size in parts) // factor, layer.exact(param))
    for shard, offset, size in parts:
        layer.weight_loader(param, FusedPart(source, dim, offset // factor, size // factor), shard)


def _packed(param: nn.Parameter, dim: int) -> int:
    """How many logical elements one stored element along ``dim`` holds (see quantization.base)."""
    return getattr(param, "pack_factor", 1) if getattr(param, "packed_dim", None) == dim else 1


class LinearBase(nn.Module):
    """A linear layer whose parameters and matmul belong to its ``LinearMethod`` (unquantized
    by default; a ``QuantizationConfig`` picks another by the layer's ``prefix``). The layer
    itself owns the bias and the tensor-parallel sharding (its ``weight_loader``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features, self.prefix = in_features, out_features, prefix
        method = quant_config.get_linear_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethod = method or UnquantizedLinearMethod()
        sizes = getattr(self, "output_partition_sizes", None) or [out_features]
        self.quant_method.create_weights(self, in_features, out_features, list(sizes), dtype, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, "output_dim": 0, "input_dim": None})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        raise NotImplementedError

    def exact(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s checkpoint tensor must hold exactly its extents (``check_extent``):
        the bias always, the method's parameters where its layout says so."""
        return param is self.bias or self.quant_method.exact_extents

    def pack_weight(self) -> bool:
        """Move the weight into oneDNN's layout (CPU, after loading); False where it cannot
        (or the layer is quantized and has its own kernel layout)."""
        return self.quant_method.pack_weight(self)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        copy_checked(param.data, full(source), self.exact(param))


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(in_features, divide(out_features, tp.size), bias, dtype, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        dim, exact = getattr(param, "output_dim", None), self.exact(param)
        if dim is None:
            copy_checked(param.data, full(source), exact)
            return
        size = param.shape[dim]
        check_extent(source, dim, size * self.tp_size, exact)
        copy_checked(param.data, load_along(source, dim, self.tp_rank * size, size), exact)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(forward(rms_norm(h) * norm_weight), h)`` for the residual stream ``h = x + residual``
        (``x`` without one): the RMSNorm before the projection folded into a one-row GPU product
        (``skinny_gemm.norm_linear``); None where that does not apply (a quantized weight, the CPU,
        more rows): the caller then runs the norm and the projection apart."""
        if type(self.quant_method) is not UnquantizedLinearMethod or not skinny_gemm.norm_applies(x, self.weight):
            return None
        return skinny_gemm.norm_linear(x, residual, norm_weight, eps, self.weight, self.bias)

    def _load_shard(self, param: nn.Parameter, source: Any, index: int, offset: int, size: int,
                    rank: int, total: int) -> None:
        """Copy this rank's part of one fused projection (logical ``offset``/``size`` along the
        output features of this rank's tensor; ``total``: the projection's logical size over all
        ranks, what the checkpoint tensor must hold) into ``param``."""
        exact = self.exact(param)
        if getattr(param, "per_shard", False):
            copy_checked(param.data[index], full(source), exact)
            return
        dim = getattr(param, "output_dim", None)
        if dim is None:
            copy_checked(param.data, full(source), exact)
            return
        factor = _packed(param, dim)
        offset, size = offset // factor, size // factor
        check_extent(source, dim, total // factor, exact)
        copy_checked(param.data.narrow(dim, offset, size), load_along(source, dim, rank * size, size), exact)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.out_sizes = out_sizes
        self.output_partition_sizes = [divide(s, get_tp().size) for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, dtype, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        if shard_id is None:  # the checkpoint stores the projections fused, in this order
            offsets = [sum(self.out_sizes[:i]) for i in range(len(self.out_sizes))]
            load_fused(self, param, source, [(i, o, n) for i, (o, n) in enumerate(zip(offsets, self.out_sizes))])
            return
        size = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        self._load_shard(param, source, shard_id, offset, size, self.tp_rank, self.out_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. Heads are split across ranks; when there are fewer
    K/V heads than ranks each K/V head is replicated on ``tp_size / num_kv_heads`` ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp = get_tp()
        self.head_dim = head_dim
        self.total_sizes = (num_heads * head_dim, num_kv_heads * head_dim)  # q and each of k, v
        self.num_heads = divide(num_heads, tp.size)
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size)
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp.size, num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        self.output_partition_sizes = [self.q_size, self.kv_size, self.kv_size]
        super().__init__(hidden, out, bias, dtype, quant_config, prefix)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: str | None = None) -> None:
        if shard_id is None:  # the checkpoint stores q, k and v fused, in this order
            q, kv = self.total_sizes
            load_fused(self, param, source, [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)])
            return
        if shard_id == "q":
            offset, size, rank, total = 0, self.q_size, self.tp_rank, self.total_sizes[0]
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank, total = self.kv_size, self.tp_rank // self.kv_replicas, self.total_sizes[1]
        self._load_shard(param, source, "qkv".index(shard_id), offset, size, rank, total)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    input_sharded = True  # a row of the weight spans the ranks (online quantization reduces its max)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(divide(in_features, tp.size), out_features, bias, dtype, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        dim, exact = getattr(param, "input_dim", None), self.exact(param)
        if dim is None:  # the bias (added once, after the reduction), per-channel scales
            copy_checked(param.data, full(source), exact)
            return
        size = param.shape[dim]
        check_extent(source, dim, size * self.tp_size, exact)
        copy_checked(param.data, load_along(source, dim, self.tp_rank * size, size), exact)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x, None))
        return y + self.bias if self.bias is not None else y

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``forward(silu(gate) * up)`` of ``gate_up`` = gate | up, the activation folded into a
        few-row GPU product (``skinny_gemm.silu_mul_linear``); None where that does not apply
        (a quantized weight, the CPU, more rows): the caller then runs the two apart."""
        if type(self.quant_method) is not UnquantizedLinearMethod or not skinny_gemm.applies(gate_up, self.weight):
            return None
        y = all_reduce(skinny_gemm.silu_mul_linear(gate_up, self.weight))
        return y + self.bias if self.bias is not None else y
