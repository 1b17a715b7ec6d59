"""MXFP4 checkpoints (``quant_method: mxfp4``, gpt-oss as published): the routed experts'
weights in the OCP microscaling FP4 format, dequantized at load to the model dtype.

Layout, per stacked expert tensor ``P`` (``gate_up_proj``, ``down_proj``):

- ``P_blocks`` uint8 ``[E, out, G, 16]``: each byte holds two FP4 (E2M1) codes, the element at
  the even index in the low nibble and the next one in the high nibble, so a row of ``G``
  blocks covers ``G * 32`` input features;
- ``P_scales`` uint8 ``[E, out, G]``: one E8M0 exponent per block of 32, the block's scale
  being ``2 ** (s - 127)``.

The dequantized expert is ``[out, in]``; ``checkpoint_tensors`` hands it to the model as the
unquantized checkpoint's ``P`` (``[E, in, out]``, transformers' layout), lazily: each expert
is dequantized only when the model's loader reads it, so a rank reads its own experts and the
whole stack never exists in float at once. Every other tensor (attention, router, biases,
embeddings: kept in bf16 by the format) passes through, and every linear layer stays
unquantized. Cost: the experts take 16-bit (or the model dtype's) memory instead of ~4.25 bits
per weight; values are exact (every FP4 value times a power of two fits bf16's exponent
range), so outputs equal the published model's dequantized reference.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig

# The sixteen E2M1 values by code: sign bit 3, then exponent and mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


class Mxfp4Experts:
    """A stacked expert tensor ``[E, in, out]`` read from its MXFP4 blocks and scales on demand:
    ``source[a:b]`` dequantizes experts ``a..b-1`` only."""

    def __init__(self, blocks: Any, scales: Any) -> None:
        self.blocks, self.scales = blocks, scales

    def get_shape(self) -> list[int]:
        e, out, g, _ = _shape(self.blocks)
        return [e, g * 32, out]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice) and index.step in (None, 1):
            return dequantize_mxfp4(self.blocks[index], self.scales[index]).transpose(1, 2)
        raise TypeError("an MXFP4 expert tensor is read by ranges of experts only")


def _shape(source: Any) -> list[int]:
    return list(source.shape) if isinstance(source, torch.Tensor) else list(source.get_shape())


class Mxfp4Config(QuantizationConfig):
    """The format's options as the checkpoint states them; no linear layer is quantized."""

    name = "mxfp4"

    def __init__(self, skip: list[str]) -> None:
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "Mxfp4Config":
        if not from_checkpoint:
            raise ValueError("mxfp4 is a checkpoint format, not an online --quantization method")
        return cls(list(config.get("modules_to_not_convert") or []))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None  # the format covers the routed experts only

    def checkpoint_tensors(self, tensors: Iterator[tuple[Any, str, Any]]) -> Iterator[tuple[Any, str, Any]]:
        """``P_blocks`` + ``P_scales`` become ``P`` (an ``Mxfp4Experts``); the rest passes through."""
        pending: dict[str, dict[str, Any]] = {}
        for file, name, source in tensors:
            suffix = _BLOCKS if name.endswith(_BLOCKS) else _SCALES if name.endswith(_SCALES) else None
            if suffix is None:
                yield file, name, source
                continue
            base = name[:-len(suffix)]
            parts = pending.setdefault(base, {})
            parts[suffix] = source
            if len(parts) == 2:
                del pending[base]
                yield file, base, Mxfp4Experts(parts[_BLOCKS], parts[_SCALES])
        if pending:
            base, parts = next(iter(pending.items()))
            raise ValueError(f"mxfp4 checkpoint: {base} has {next(iter(parts))[1:]} without its "
                             f"{'scales' if _BLOCKS in parts else 'blocks'}")
