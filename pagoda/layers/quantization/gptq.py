"""GPTQ checkpoints (AutoGPTQ, GPTQModel; ``quant_method: gptq``), 4 and 8 bits.

Per linear layer, with ``k = 32 // bits`` values per int32 word, least significant first:

- ``qweight`` int32 ``[in / k, out]``: codes in ``[0, 2**bits)``, packed along the input dim;
- ``qzeros`` int32 ``[groups, out / k]``: zero points, packed along the output dim;
- ``scales`` float16 ``[groups, out]``;
- ``g_idx`` int32 ``[in]``: each input column's group (``i // group_size`` unless ``desc_act``,
  whose act order permutes it);
- ``W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`` with ``g = g_idx[i]``.

``checkpoint_format: gptq`` (v1, the default and the classic layout) stores each zero point
minus one, done by subtracting ``0x11111111`` (4 bits) / ``0x01010101`` (8 bits) from every
packed word; pagoda adds it back word-wise, which also restores a zero point of 0 whose
subtraction borrowed from its neighbour. ``gptq_v2`` stores zero points as they are.

Tensor parallelism: column-parallel layers split the output dim of all three tensors;
row-parallel layers split ``qweight`` and ``g_idx`` by input and ``scales``/``qzeros`` by
group (a size that would split a group is refused). With ``desc_act`` a row-parallel rank's
columns belong to any group, so it keeps every group's scales and zeros.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, WeightLoader, new_parameter
from pagoda.layers.quantization.layer_names import checkpoint_modules
from pagoda.layers.quantization.int_packed import (SUPPORTED_BITS, add_group_index, check_groups,
                                                   full_in_features, group_index, grouped_int_linear,
                                                   is_row_parallel, unpack_int32)

_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, v1: bool, modules: list[str] | None) -> None:
        self.bits, self.group_size, self.desc_act, self.v1 = bits, group_size, desc_act, v1
        self.modules = modules  # modules_in_block_to_quantize, flattened; None: every linear

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "GPTQConfig":
        bits = config.get("bits", config.get("w_bit"))
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ checkpoints with bits={bits!r} are not supported; pagoda reads 4 and 8 bits")
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if config.get("is_marlin_format") or fmt not in _FORMATS:
            fmt = "marlin" if config.get("is_marlin_format") else fmt
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; pagoda reads the "
                             f"{' and '.join(_FORMATS)} layouts")
        group = config.get("group_size", -1)
        if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0):
            raise ValueError(f"GPTQ group_size must be a positive integer or -1, got {group!r}")
        if config.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        if config.get("dynamic"):
            raise ValueError("GPTQ checkpoints with per-module overrides ('dynamic') are not supported")
        if str(config.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
            raise ValueError(f"GPTQ pack_dtype {config['pack_dtype']!r} is not supported; pagoda reads int32 words")
        blocks = config.get("modules_in_block_to_quantize")
        modules = [m for block in blocks for m in block] if blocks else None
        return cls(bits, group, bool(config.get("desc_act", False)), fmt == "gptq", modules)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.modules is not None:
            quantized = [any(name.endswith("." + m) for m in self.modules) for name in checkpoint_modules(prefix)]
            if not any(quantized):
                return None
            if not all(quantized):
                raise ValueError(f"{prefix}: modules_in_block_to_quantize quantizes only some of its fused "
                                 "projections; pagoda needs them quantized alike")
        return GPTQLinearMethod(self)

    def __repr__(self) -> str:
        return (f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
                f"checkpoint_format={'gptq' if self.v1 else 'gptq_v2'})")


class GPTQLinearMethod(LinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        cfg, k = self.config, 32 // self.config.bits
        full_in = full_in_features(layer, in_features)
        group = full_in if cfg.group_size == -1 else cfg.group_size
        # Groups follow the input split, except one group over everything or act order, where
        # every rank needs every group.
        whole = cfg.group_size == -1 or (cfg.desc_act and in_features != full_in)
        if not whole:
            check_groups(layer, in_features, group, "GPTQ")
        groups = -(-full_in // group) if whole else in_features // group
        _check_packing(layer, in_features, output_partition_sizes, k)
        layer.gptq_dtype, layer.gptq_first_group = dtype, 0 if whole else layer_rank(layer) * groups
        group_dim = None if whole else 0
        new_parameter(layer, "qweight", (in_features // k, out_features), torch.int32, weight_loader,
                      input_dim=0, output_dim=1, packed_dim=0, pack_factor=k)
        new_parameter(layer, "qzeros", (groups, out_features // k), torch.int32, weight_loader,
                      input_dim=group_dim, output_dim=1, packed_dim=1, pack_factor=k)
        new_parameter(layer, "scales", (groups, out_features), torch.float32, weight_loader,
                      input_dim=group_dim, output_dim=1)
        add_group_index(layer, "g_idx", in_features, len(output_partition_sizes), optional=not cfg.desc_act)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        bits = self.config.bits
        q = unpack_int32(layer.qweight.data, bits, 0).t()  # [out, in]
        zeros = zero_points(layer.qzeros.data, bits, self.config.v1).t()  # [out, groups]
        scales = layer.scales.data.t()
        g_idx = group_index(layer, "g_idx", layer.gptq_first_group, scales.shape[1])
        layer.qlinear = grouped_int_linear(q, scales, zeros, bits, g_idx, layer.gptq_dtype)
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.qlinear(x, bias)


def zero_points(qzeros: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    """``[groups, out]`` zero points of ``qzeros`` words. v1 stored each one minus one by a
    word-wise subtraction, undone here by the word-wise addition (mod 2**32), so a zero point
    of 0, whose subtraction borrowed from the next field, comes back whole."""
    words = qzeros.to(torch.int64)
    if v1:
        words = words + sum(1 << (bits * j) for j in range(32 // bits))
    return unpack_int32(words, bits, 1)


def layer_rank(layer: nn.Module) -> int:
    return getattr(layer, "tp_rank", 0) if is_row_parallel(layer) else 0


def _check_packing(layer: nn.Module, in_features: int, sizes: list[int], k: int) -> None:
    if in_features % k:
        raise ValueError(f"GPTQ: {layer.prefix} has {in_features} input features (per rank), not a multiple "
                         f"of the {k} values packed per int32 word")
    if any(s % k for s in sizes):
        raise ValueError(f"GPTQ: {layer.prefix}'s output sizes {sizes} (per rank) are not multiples of the "
                         f"{k} zero points packed per int32 word")
