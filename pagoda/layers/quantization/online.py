"""Online weight quantization of a float checkpoint (``--quantization int8|int4|fp8``).

The layer loads its dense weight as usual (same parameter, same tensor-parallel sharding);
``process_weights_after_loading`` quantizes this rank's shard and drops the dense copy. A
row-parallel layer's per-row scales come from the maximum over all ranks, so tensor
parallelism quantizes exactly as one rank does.

- ``int8``: symmetric per output channel, ``scale = max|w| / 127``, values -127..127.
- ``int4``: symmetric per group of ``group_size`` input columns (default 128; option
  ``{"group_size": N}``, N dividing every layer's input features on this rank, or -1 for the
  whole row: of this rank's shard in a row-parallel layer), ``scale = max|w| / 7.5``, values -8..7 stored as 0..15 around a zero point of 8.
- ``fp8``: float8 e4m3 with ``scale = max|w| / 448`` per output channel; multiplied in fp8 with
  per-token activation scales (W8A8, ``fp8_w8a8.py``) on cards with fp8, else dequantized on the fly.

Every rounding is to nearest, so a weight's error is at most half a step (``scale / 2``; for
fp8 a relative 2**-4 of the value, or ``scale * 2**-10`` in the subnormal range).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.distributed.parallel_state import all_reduce_max
from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, WeightLoader, new_parameter
from pagoda.layers.quantization.fp8_w8a8 import quantize_rows, w8a8_linear
from pagoda.layers.quantization.kernels import QuantLinear, make_fp8_linear, make_int4_linear, make_int8_linear

INT4_DEFAULT_GROUP_SIZE = 128


def row_amax(layer: nn.Module | None, w: torch.Tensor) -> torch.Tensor:
    """``max |w|`` per output row; of the whole row across ranks when the layer's input (a
    row-parallel layer) is sharded, so every rank quantizes with the scale one rank would."""
    amax = w.to(torch.float32).abs().amax(dim=1)
    if getattr(layer, "input_sharded", False):
        all_reduce_max(amax)
    return amax


def quantize_int8(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q [N, K] int8, scales [N] float32)``, ``w ~ scales[:, None] * q``."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1) if amax is None else amax
    scales = amax.clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric grouped int4: ``(q [N, K] uint8 in 0..15, scales [N, K // group_size])`` with
    ``w ~ scales * (q - 8)`` group by group."""
    n, k = w.shape
    groups = w.to(torch.float32).reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(dim=2).clamp(min=1e-12) / 7.5
    q = torch.round(groups / scales[:, :, None]).clamp(-8, 7) + 8
    return q.reshape(n, k).to(torch.uint8), scales


def quantize_fp8(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3: ``(w8 [N, K] float8_e4m3fn, scales [N])``, ``w ~ scales[:, None] * w8``
    (``fp8_w8a8.quantize_rows``, the activations' quantizer too)."""
    return quantize_rows(w, amax)


class OnlineLinearMethod(LinearMethod):
    """Loads the dense weight like the unquantized method, then quantizes it in place."""

    exact_extents = True

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        self.check_shape(layer, in_features)
        new_parameter(layer, "weight", (out_features, in_features), dtype, weight_loader,
                      output_dim=0, input_dim=1)

    def check_shape(self, layer: nn.Module, in_features: int) -> None:
        """Raise ``ValueError`` when this method cannot quantize a layer of this width."""

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> QuantLinear:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        layer.qlinear = self.quantize(layer, layer.weight.data)
        del layer.weight  # the dense copy is no longer needed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.qlinear(x, bias)


class Int8LinearMethod(OnlineLinearMethod):
    def quantize(self, layer: nn.Module, w: torch.Tensor) -> QuantLinear:
        q, scales = quantize_int8(w, row_amax(layer, w))
        return make_int8_linear(q, scales)


class Int4LinearMethod(OnlineLinearMethod):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def _group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def check_shape(self, layer: nn.Module, in_features: int) -> None:
        if in_features % self._group(in_features):
            raise ValueError(
                f"int4 group_size {self.group_size} does not divide the {in_features} input features of "
                f"{getattr(layer, 'prefix', '') or type(layer).__name__} (per tensor-parallel rank); choose a "
                "divisor with --quantization-config '{\"group_size\": N}', or -1 for whole rows")

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> QuantLinear:
        group = self._group(w.shape[1])
        q, scales = quantize_int4(w, group)
        return make_int4_linear(q, scales, None, group, dtype=w.dtype)


class Fp8LinearMethod(OnlineLinearMethod):
    def quantize(self, layer: nn.Module, w: torch.Tensor) -> QuantLinear:
        w8, scales = quantize_fp8(w, row_amax(layer, w))
        return w8a8_linear(w8, scales) or make_fp8_linear(w8, scales)


class _OnlineConfig(QuantizationConfig):
    """Quantizes every decoder linear layer; embeddings stay float, and so does the LM head
    unless the option ``{"lm_head": true}`` asks for it (as llama.cpp's Q8_0 / Q4_0 files
    quantize their output matrix)."""

    options: tuple[str, ...] = ("lm_head",)

    def __init__(self, method: OnlineLinearMethod, config: dict[str, Any] | None = None) -> None:
        self.method = method
        lm_head = (config or {}).get("lm_head", False)
        if not isinstance(lm_head, bool):
            raise ValueError(f"--quantization-config 'lm_head' must be true or false; got {lm_head!r}")
        self.quantize_lm_head = lm_head

    @classmethod
    def check_options(cls, config: dict[str, Any], from_checkpoint: bool) -> None:
        if from_checkpoint:
            raise ValueError(f"checkpoints pre-quantized with quant_method {cls.name!r} are not supported")
        unknown = sorted(set(config) - set(cls.options))
        if unknown:
            allowed = ", ".join(cls.options) or "none"
            raise ValueError(f"--quantization-config keys {unknown} are not options of {cls.name!r} "
                             f"(options: {allowed})")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return self.method

    def get_lm_head_method(self) -> LinearMethod | None:
        return self.method if self.quantize_lm_head else None


class Int8Config(_OnlineConfig):
    name = "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "Int8Config":
        cls.check_options(config, from_checkpoint)
        return cls(Int8LinearMethod(), config)


class Int4Config(_OnlineConfig):
    name = "int4"
    options = ("group_size", "lm_head")

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "Int4Config":
        cls.check_options(config, from_checkpoint)
        group = config.get("group_size", INT4_DEFAULT_GROUP_SIZE)
        if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group >= 2):
            raise ValueError(f"int4 group_size must be an integer >= 2, or -1 for whole rows; got {group!r}")
        made = cls(Int4LinearMethod(group), config)
        made.group_size = group
        return made

    def __repr__(self) -> str:
        return f"Int4Config(group_size={self.group_size})"


class Fp8Config(_OnlineConfig):
    name = "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "Fp8Config":
        cls.check_options(config, from_checkpoint)
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("--quantization fp8 needs a torch build with float8_e4m3fn")
        return cls(Fp8LinearMethod(), config)
