"""Shared pieces of the integer checkpoint formats (GPTQ, AWQ, compressed-tensors pack-quantized):
unpacking int32 words into their bit fields, and turning unpacked codes with per-group scales,
zero points and a group index into one of the kernels in ``kernels.py``."""
from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.quantization.kernels import DequantLinear, QuantLinear, make_int4_linear, make_int8_linear

SUPPORTED_BITS = (4, 8)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``bits``-wide fields of int32 ``words`` as int32 values in ``[0, 2**bits)``, laid out
    along ``dim``: stored element ``w`` becomes logical elements ``w*k .. w*k+k-1``
    (``k = 32 // bits``), the least significant field first."""
    k = 32 // bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    shape = [1] * (words.dim() + 1)
    shape[dim + 1] = k
    fields = (u.unsqueeze(dim + 1) >> shifts.view(shape)) & (2**bits - 1)
    out_shape = list(words.shape)
    out_shape[dim] *= k
    return fields.reshape(out_shape).to(torch.int32)


def is_row_parallel(layer: nn.Module) -> bool:
    from pagoda.layers.linear import RowParallelLinear

    return isinstance(layer, RowParallelLinear)


def full_in_features(layer: nn.Module, in_features: int) -> int:
    """The layer's input width before tensor-parallel splitting."""
    return in_features * getattr(layer, "tp_size", 1) if is_row_parallel(layer) else in_features


def check_groups(layer: nn.Module, in_features: int, group_size: int, fmt: str) -> None:
    """A row-parallel rank must hold whole groups (its scales and zeros are a slice of rows)."""
    if group_size <= 0 or in_features % group_size == 0:
        return
    tp = getattr(layer, "tp_size", 1)
    where = (f"its {in_features} input features per rank ({in_features * tp} split over "
             f"--tensor-parallel-size {tp})" if tp > 1 else f"its {in_features} input features")
    raise ValueError(f"{fmt}: group_size {group_size} does not divide {where} in {layer.prefix}"
                     + ("; a tensor-parallel size that splits a quantization group is not supported,"
                        " choose a smaller one" if tp > 1 else ""))


def contiguous_groups(g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor | None, int] | None:
    """For a group index over ``K`` input columns: ``(perm, group_size)`` such that the columns
    ``perm`` (None: in order) form ``groups`` consecutive groups of ``group_size``; None when the
    groups are not all the same size (a row-parallel slice of an act-order layer)."""
    k = g_idx.numel()
    counts = torch.bincount(g_idx.long(), minlength=groups)
    if counts.numel() != groups or k % groups or bool((counts != k // groups).any()):
        return None
    size = k // groups
    if torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // size):
        return None, size
    return torch.argsort(g_idx.long(), stable=True), size


def grouped_int_linear(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                       g_idx: torch.Tensor | None, dtype: torch.dtype) -> QuantLinear:
    """The kernel for ``W[n, k] = scales[n, g(k)] * (q[n, k] - zeros[n, g(k)])``.

    ``q``: ``[N, K]`` unsigned codes in ``[0, 2**bits)``; ``scales``, ``zeros``: ``[N, G]`` (zero
    points in code units); ``g_idx``: the group of each input column, or None for ``G``
    consecutive groups. Act-order layers become an input permutation that makes their groups
    consecutive; groups of unequal size dequantize on every call."""
    n, k = q.shape
    groups = scales.shape[1]
    perm: torch.Tensor | None = None
    if g_idx is None:
        group_size = k // groups
    else:
        order = contiguous_groups(g_idx, groups)
        if order is None:
            return _gathered_linear(q, scales, zeros, g_idx)
        perm, group_size = order
        if perm is not None:
            q = q[:, perm]
    scales = scales.to(torch.float32)
    zeros = zeros.to(torch.float32)
    if bits == 4:
        return make_int4_linear(q, scales, zeros, group_size, perm, dtype=dtype)
    mid = 2 ** (bits - 1)
    signed_zeros = zeros - mid
    return make_int8_linear((q - mid).to(torch.int8), scales, None if not signed_zeros.any() else signed_zeros,
                            group_size, perm)


def _gathered_linear(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor) -> QuantLinear:
    g = g_idx.long()
    q8 = q.to(torch.uint8)
    s, z = scales.to(torch.float32), zeros.to(torch.float32)

    def dequantize(dtype: torch.dtype) -> torch.Tensor:
        return ((q8.to(torch.float32) - z[:, g]) * s[:, g]).to(dtype)

    return DequantLinear(dequantize, (q8, s, z, g))


# --------------------------------------------------------------- parameters with their own loaders


def shard_index(shard_id: object) -> int:
    """Row of a per-projection tensor: q/k/v -> 0/1/2, gate/up -> 0/1, an unfused layer -> 0."""
    if isinstance(shard_id, str):
        return "qkv".index(shard_id)
    return int(shard_id or 0)


def rank_slice(layer: nn.Module, values: torch.Tensor, in_features: int) -> torch.Tensor:
    """This rank's part of a per-input-column tensor (row-parallel layers split the inputs)."""
    if not is_row_parallel(layer):
        return values
    start = layer.tp_rank * in_features
    return values[start:start + in_features]


def add_group_index(layer: nn.Module, name: str, in_features: int, shards: int, optional: bool) -> None:
    """A per-input-column group index (GPTQ ``g_idx``, compressed-tensors ``weight_g_idx``), one
    row per fused projection so that ``group_index`` can check they agree; -1 until loaded."""
    from pagoda.layers.linear import full
    from pagoda.layers.quantization.base import new_parameter

    def load(param: nn.Parameter, source: object, shard_id: object = None) -> None:
        param.data[shard_index(shard_id)].copy_(rank_slice(layer, full(source), in_features))

    param = new_parameter(layer, name, (shards, in_features), torch.int32, load, optional=optional)
    param.data.fill_(-1)


def group_index(layer: nn.Module, name: str, first_group: int, groups: int) -> torch.Tensor | None:
    """The loaded group index, shifted to this rank's first group, or None when the checkpoint
    had none. Fused projections must share it (they share their input: one permutation)."""
    rows = getattr(layer, name).data
    loaded = rows[(rows >= 0).all(dim=1)]
    delattr(layer, name)
    if loaded.shape[0] == 0:
        return None
    if loaded.shape[0] != rows.shape[0] or bool((loaded != loaded[0]).any()):
        raise ValueError(f"{layer.prefix}: the fused projections' {name} differ; pagoda needs one input "
                         "order per fused layer")
    g = loaded[0].to(torch.int64) - first_group
    if bool((g < 0).any()) or bool((g >= groups).any()):
        raise ValueError(f"{layer.prefix}: {name} refers to groups outside the {groups} this rank holds")
    return g
