"""AWQ checkpoints in AutoAWQ's GEMM layout (``quant_method: awq``, ``version: gemm``), 4 bits
with zero points.

Per linear layer: ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[groups, out / 8]``,
both packed along the output dim in AutoAWQ's interleaved order (nibble ``j`` of word ``c``
holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][j]``); ``scales`` float16 ``[groups, out]``;
``W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`` with ``g = i // group_size``. Zero points
are stored as they are (no offset). Tensor parallelism splits like GPTQ without act order.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, WeightLoader, new_parameter
from pagoda.layers.quantization.layer_names import checkpoint_modules
from pagoda.layers.quantization.int_packed import check_groups, grouped_int_linear, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_UNPACK_ORDER = [AWQ_ORDER.index(c) for c in range(8)]  # column c of a word sits in nibble _UNPACK_ORDER[c]


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, skip: list[str]) -> None:
        self.group_size, self.skip = group_size, skip

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "AWQConfig":
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ValueError(f"AWQ checkpoints with bits={bits!r} are not supported; pagoda reads 4-bit AWQ")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported; pagoda reads the GEMM layout "
                             "(version 'gemm')")
        if not config.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
        group = config.get("group_size", config.get("q_group_size", 128))
        if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0):
            raise ValueError(f"AWQ group_size must be a positive integer or -1, got {group!r}")
        return cls(group, list(config.get("modules_to_not_convert") or []))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        # AutoAWQ leaves a module dense when any listed name occurs in its name.
        skipped = [any(s in name for s in self.skip) for name in checkpoint_modules(prefix)]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: modules_to_not_convert leaves only some of its fused projections "
                             "dense; pagoda needs them quantized alike")
        return AWQLinearMethod(self.group_size)

    def __repr__(self) -> str:
        return f"AWQConfig(bits=4, group_size={self.group_size}, version=gemm)"


class AWQLinearMethod(LinearMethod):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        whole = self.group_size == -1
        if not whole:
            check_groups(layer, in_features, self.group_size, "AWQ")
        if any(s % 8 for s in output_partition_sizes):
            raise ValueError(f"AWQ: {layer.prefix}'s output sizes {output_partition_sizes} (per rank) are not "
                             "multiples of the 8 values packed per int32 word")
        groups = 1 if whole else in_features // self.group_size
        layer.awq_dtype = dtype
        group_dim = None if whole else 0
        new_parameter(layer, "qweight", (in_features, out_features // 8), torch.int32, weight_loader,
                      input_dim=0, output_dim=1, packed_dim=1, pack_factor=8)
        new_parameter(layer, "qzeros", (groups, out_features // 8), torch.int32, weight_loader,
                      input_dim=group_dim, output_dim=1, packed_dim=1, pack_factor=8)
        new_parameter(layer, "scales", (groups, out_features), torch.float32, weight_loader,
                      input_dim=group_dim, output_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        q = _unpack_awq(layer.qweight.data).t()  # [out, in]
        zeros = _unpack_awq(layer.qzeros.data).t()  # [out, groups]
        layer.qlinear = grouped_int_linear(q, layer.scales.data.t(), zeros, 4, None, layer.awq_dtype)
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.qlinear(x, bias)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """``[rows, cols / 8]`` AWQ words -> ``[rows, cols]`` codes in column order."""
    rows = words.shape[0]
    fields = unpack_int32(words, 4, 1).view(rows, -1, 8)
    return fields[:, :, _UNPACK_ORDER].reshape(rows, -1)

