"""compressed-tensors checkpoints (llm-compressor; ``quant_method: compressed-tensors``).

``config_groups`` map module targets (``Linear``, exact names, ``re:`` regexes) to a scheme;
``ignore`` lists modules left dense. pagoda reads two kinds of scheme:

- ``pack-quantized`` integer weights, 4 or 8 bits, ``group`` or ``channel`` strategy,
  symmetric or not, no activation quantization (W4A16, W8A16): ``weight_packed`` int32
  ``[out, in / k]`` (``k = 32 // bits`` values per word along the input dim, each signed value
  stored plus ``2**(bits-1)``), ``weight_scale`` ``[out, groups]`` (``[out, 1]`` per channel),
  ``weight_shape`` ``[out, in]``, and for asymmetric schemes ``weight_zero_point`` stored the
  same way but packed along the output dim (``[out / k, groups]``); ``actorder: group`` adds
  ``weight_g_idx`` (handled like GPTQ's act order). ``W = scale * (q - zero_point)``.
- ``float-quantized`` fp8 e4m3 weights with ``tensor``, ``channel`` or ``block`` scales
  (``weight_scale``), activations unquantized or dynamic (FP8, FP8_DYNAMIC, FP8_BLOCK; see
  ``fp8_block`` and ``fp8_w8a8`` for where dynamic activations run W8A8 and where weight-only).

Anything else is refused by name: integer activation quantization (W8A8, ``int-quantized``),
static activation scales, other bit widths, NVFP4/MXFP4, sparsity, transforms, KV-cache schemes.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, WeightLoader, new_parameter
from pagoda.layers.quantization.layer_names import checkpoint_modules, name_matches, one_choice
from pagoda.layers.quantization.fp8_block import (Fp8BlockMethod, Fp8ChannelMethod, Fp8TensorMethod,
                                                  fp8_dtype_check, note_dynamic_activations)
from pagoda.layers.quantization.gptq import layer_rank
from pagoda.layers.quantization.int_packed import (SUPPORTED_BITS, add_group_index, check_groups,
                                                   full_in_features, group_index, grouped_int_linear,
                                                   shard_index, unpack_int32)

_LAYER_CLASSES = ("Linear",)  # class-name targets a decoder projection answers to


def _refuse(group: str, what: str) -> ValueError:
    return ValueError(f"compressed-tensors scheme {group!r}: {what} is not supported; pagoda reads "
                      "pack-quantized W4A16/W8A16 (group or channel) and float-quantized FP8 weights "
                      "(tensor, channel or block scales; dynamic or no activation quantization)")


def _scheme(name: str, group: dict[str, Any], default_format: str | None) -> tuple[str, dict]:
    """Validate one config group; returns its kind (``int`` or ``fp8``) and weight arguments."""
    weights = group.get("weights")
    fmt = group.get("format") or default_format
    if not isinstance(weights, dict):
        raise _refuse(name, "a scheme without weight quantization")
    if group.get("output_activations"):
        raise _refuse(name, "output activation quantization")
    inputs = group.get("input_activations")
    kind, bits = weights.get("type"), weights.get("num_bits")
    if weights.get("dynamic"):
        raise _refuse(name, "dynamic weight quantization")
    if kind == "int":
        if inputs:
            raise _refuse(name, f"{inputs.get('type')}{inputs.get('num_bits')} activation quantization "
                                f"(W{bits}A{inputs.get('num_bits')})")
        if fmt != "pack-quantized":
            raise _refuse(name, f"integer weights in format {fmt!r}")
        if bits not in SUPPORTED_BITS:
            raise _refuse(name, f"{bits}-bit integer weights")
        if weights.get("strategy") not in ("group", "channel"):
            raise _refuse(name, f"the {weights.get('strategy')!r} strategy for integer weights")
        if weights.get("strategy") == "group" and not (isinstance(weights.get("group_size"), int)
                                                       and weights["group_size"] > 0):
            raise _refuse(name, f"group_size {weights.get('group_size')!r}")
        if weights.get("actorder") not in (None, "weight", "static", "group", "dynamic"):
            raise _refuse(name, f"actorder {weights.get('actorder')!r}")
        return "int", weights
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(name, f"{bits}-bit float weights in format {fmt!r}")
        fp8_dtype_check("an FP8 compressed-tensors checkpoint")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise _refuse(name, f"the {weights.get('strategy')!r} strategy for fp8 weights")
        if inputs:
            if inputs.get("type") != "float" or not inputs.get("dynamic"):
                raise _refuse(name, "static or integer activation quantization (input scales)")
            note_dynamic_activations(f"compressed-tensors scheme {name!r}")
        return "fp8", weights
    raise _refuse(name, f"weights of type {kind!r}")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], str, dict]], ignore: list[str]) -> None:
        self.groups, self.ignore = groups, ignore

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "CompressedTensorsConfig":
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors checkpoints with quantization_status {status!r} are not "
                             "supported; pagoda reads compressed ones")
        for key, what in (("sparsity_config", "sparsity (sparse weights)"), ("transform_config", "transforms"),
                          ("kv_cache_scheme", "a KV-cache quantization scheme (kv_cache_scheme)")):
            if config.get(key):
                raise ValueError(f"compressed-tensors checkpoints with {what} are not supported")
        raw = config.get("config_groups") or {}
        if not raw:
            raise ValueError("compressed-tensors checkpoint has no config_groups")
        groups = []
        for name, group in raw.items():
            kind, weights = _scheme(name, group, config.get("format"))
            groups.append((list(group.get("targets") or []), kind, weights))
        return cls(groups, list(config.get("ignore") or []))

    def _scheme_of(self, name: str) -> tuple[str, dict] | None:
        if any(name_matches(name, pattern) for pattern in self.ignore):
            return None
        for exact in (True, False):  # a name or regex target wins over a class-name target
            for targets, kind, weights in self.groups:
                for target in targets:
                    if (target not in _LAYER_CLASSES and name_matches(name, target)) or \
                            (not exact and target in _LAYER_CLASSES):
                        return kind, weights
        return None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        schemes = [self._scheme_of(name) for name in checkpoint_modules(prefix)]
        scheme = one_choice(prefix, schemes, "targets or ignores")
        if scheme is None:
            return None
        kind, weights = scheme
        if kind == "int":
            return CTPackedMethod(weights)
        strategy = weights["strategy"]
        if strategy == "tensor":
            return Fp8TensorMethod()
        if strategy == "channel":
            return Fp8ChannelMethod()
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"compressed-tensors fp8 block strategy needs block_structure [rows, cols], got {block!r}")
        return Fp8BlockMethod((block[0], block[1]), "weight_scale")

    def __repr__(self) -> str:
        kinds = [f"{k}{w.get('num_bits')}/{w.get('strategy')}" for _, k, w in self.groups]
        return f"CompressedTensorsConfig({', '.join(kinds)})"


class CTPackedMethod(LinearMethod):
    """pack-quantized integer weights (see the module docstring)."""

    def __init__(self, weights: dict[str, Any]) -> None:
        self.bits = weights["num_bits"]
        self.sym = bool(weights.get("symmetric", True))
        self.group_size = weights.get("group_size") if weights["strategy"] == "group" else -1
        self.actorder = weights.get("actorder") in ("group", "dynamic")

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        k = 32 // self.bits
        full_in = full_in_features(layer, in_features)
        whole = self.group_size == -1 or (self.actorder and in_features != full_in)
        group = full_in if self.group_size == -1 else self.group_size
        if not whole:
            check_groups(layer, in_features, group, "compressed-tensors")
        if in_features % k:
            raise ValueError(f"compressed-tensors: {layer.prefix} has {in_features} input features (per rank), "
                             f"not a multiple of the {k} values packed per int32 word")
        if not self.sym and any(s % k for s in output_partition_sizes):
            raise ValueError(f"compressed-tensors: {layer.prefix}'s output sizes {output_partition_sizes} (per "
                             f"rank) are not multiples of the {k} zero points packed per int32 word")
        groups = -(-full_in // group) if whole else in_features // group
        group_dim = None if whole else 1
        layer.ct_dtype, layer.ct_first_group = dtype, 0 if whole else layer_rank(layer) * groups
        new_parameter(layer, "weight_packed", (out_features, in_features // k), torch.int32, weight_loader,
                      output_dim=0, input_dim=1, packed_dim=1, pack_factor=k)
        new_parameter(layer, "weight_scale", (out_features, groups), torch.float32, weight_loader,
                      output_dim=0, input_dim=group_dim)
        if not self.sym:
            new_parameter(layer, "weight_zero_point", (out_features // k, groups), torch.int32, weight_loader,
                          output_dim=0, packed_dim=0, pack_factor=k, input_dim=group_dim)
        if self.actorder:
            add_group_index(layer, "weight_g_idx", in_features, len(output_partition_sizes), optional=False)
        self._add_shape_check(layer, full_in, len(output_partition_sizes))

    @staticmethod
    def _add_shape_check(layer: nn.Module, full_in: int, shards: int) -> None:
        def load(param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
            from pagoda.layers.linear import full

            shape = [int(v) for v in full(source).reshape(-1).tolist()]
            if len(shape) != 2 or shape[1] != full_in:
                raise ValueError(f"weight_shape {shape} does not match the {full_in} input features of {layer.prefix}")
            param.data[shard_index(shard_id)] = torch.tensor(shape)

        new_parameter(layer, "weight_shape", (shards, 2), torch.int64, load)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        out, in_features = layer.weight_packed.shape[0], layer.weight_packed.shape[1] * (32 // self.bits)
        q = unpack_int32(layer.weight_packed.data, self.bits, 1)  # unsigned: signed + 2**(bits-1)
        scales = layer.weight_scale.data
        if self.sym:
            zeros = torch.full(scales.shape, float(2 ** (self.bits - 1)))
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, 0)[:out]
        g_idx = group_index(layer, "weight_g_idx", layer.ct_first_group, scales.shape[1]) if self.actorder else None
        if g_idx is None and scales.shape[1] > 1 and in_features % scales.shape[1]:
            raise ValueError(f"{layer.prefix}: {scales.shape[1]} groups do not divide {in_features} input features")
        layer.qlinear = grouped_int_linear(q, scales, zeros, self.bits, g_idx, layer.ct_dtype)
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            if hasattr(layer, name):
                delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.qlinear(x, bias)
