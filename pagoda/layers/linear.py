"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that takes the
checkpoint tensor (or a lazy safetensors slice) and copies in only this rank's part, so loading
a sharded model is one loop and no rank materialises the full weights."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.distributed.parallel_state import all_reduce, get_tp
from pagoda.layers import cpu_gemm


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
    return source[:] if not isinstance(source, torch.Tensor) else source


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout once packed
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        raise NotImplementedError

    def pack_weight(self) -> bool:
        """Move the weight into oneDNN's layout (CPU, after loading); False where it cannot."""
        if self.packed is None:
            self.packed = cpu_gemm.pack_parameter(self.weight, keep_dense=False)
        return self.packed is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, self.packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        param.data.copy_(full(source))


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(in_features, divide(out_features, tp.size), bias, dtype)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        param.data.copy_(load_rows(source, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        assert shard_id is not None
        size = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        param.data[offset:offset + size].copy_(load_rows(source, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. Heads are split across ranks; when there are fewer
    K/V heads than ranks each K/V head is replicated on ``tp_size / num_kv_heads`` ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype) -> None:
        tp = get_tp()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size)
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size)
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp.size, num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias, dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: str | None = None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        param.data[offset:offset + size].copy_(load_rows(source, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(divide(in_features, tp.size), out_features, bias, dtype)

    def weight_loader(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(full(source))
            return
        size = param.shape[1]
        param.data.copy_(load_cols(source, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x, None))
        return y + self.bias if self.bias is not None else y
