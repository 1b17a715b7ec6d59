"""FP8 checkpoints (``quant_method: fp8``): float8_e4m3fn weights with block-wise scales, the
format DeepSeek-V3 ships, or one scale per tensor; also the FP8 linear methods compressed-tensors'
``float-quantized`` schemes use.

- Blocks (``weight_block_size: [bn, bk]``): ``weight`` ``[out, in]`` and ``weight_scale_inv``
  float32 ``[ceil(out / bn), ceil(in / bk)]``, multiplied in (despite its name):
  ``W[o, i] = weight[o, i] * weight_scale_inv[o // bn, i // bk]``.
- Per tensor (no ``weight_block_size``): ``weight`` and a scalar ``weight_scale``.

No CPU has an fp8 matmul. On a CPU the weights are therefore dequantized once, after loading,
into a dense weight of the model dtype that runs through oneDNN like an unquantized layer
(``DenseLinear``): dequantizing every step instead made a 70M-parameter model's decode ~6x
slower than float32 (docs/benchmarks.md); the price is the dense model's memory. On a GPU the
weights stay fp8. Per-tensor and per-channel weights are multiplied in fp8 with per-token
dynamic activation scales (W8A8, ``fp8_w8a8.py``) on cards with fp8 (sm_89+); on other cards,
and for block scales, they are dequantized on the fly and ``activation_scheme: dynamic`` runs
weight-only, with activations unquantized; ``static`` activation scales would be silently
dropped that way, so they are refused.

Tensor parallelism: block scales are expanded to one row per output feature when loaded (a
``[out, ceil(in / bk)]`` tensor), so column-parallel splits and fused q/k/v or gate/up
projections may cut through a block row; a row-parallel split must keep whole blocks of ``bk``
input features.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch import nn

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, WeightLoader, new_parameter
from pagoda.layers.quantization.fp8_w8a8 import block_w8a8_linear, w8a8_linear
from pagoda.layers.quantization.layer_names import checkpoint_modules
from pagoda.layers.quantization.int_packed import is_row_parallel, shard_index
from pagoda.layers.quantization.kernels import DequantLinear, QuantLinear

logger = logging.getLogger(__name__)


def fp8_dtype_check(what: str) -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"{what} needs a torch build with float8_e4m3fn")


def note_dynamic_activations(what: str) -> None:
    logger.info("%s: dynamic fp8 activations: per-token W8A8 where the weights have per-channel or "
                "per-tensor scales and the device multiplies in fp8 (fp8_w8a8.py); otherwise weight-only "
                "in the model dtype", what)


class Fp8CheckpointConfig(QuantizationConfig):
    name = "fp8"

    def __init__(self, block: tuple[int, int] | None, skip: list[str]) -> None:
        self.block, self.skip = block, skip
        self.quantized: set[str] = set()  # checkpoint modules whose layers keep fp8 weights

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "Fp8CheckpointConfig":
        fp8_dtype_check("an fp8 checkpoint")
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise ValueError(f"fp8 checkpoints with activation_scheme {scheme!r} (static input scales) are not "
                             "supported; pagoda reads activation_scheme 'dynamic'")
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoints with fmt {fmt!r} are not supported; pagoda reads e4m3 weights")
        block = config.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise ValueError(f"fp8 weight_block_size must be two positive integers, got {block!r}")
            block = (block[0], block[1])
        note_dynamic_activations("fp8 checkpoint")
        skip = list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])
        return cls(block, skip)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        names = checkpoint_modules(prefix)
        skipped = [name in self.skip for name in names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: ignored_layers leaves only some of its fused projections dense; "
                             "pagoda needs them quantized alike")
        self.quantized.update(names)
        return Fp8BlockMethod(self.block, "weight_scale_inv") if self.block else Fp8TensorMethod()

    def checkpoint_tensors(self, tensors: Iterator[tuple[Any, str, Any]]) -> Iterator[tuple[Any, str, Any]]:
        """The checkpoint's tensors as the model takes them: fp8 weights of modules pagoda builds
        unquantized (the MLA projections, routed experts) are dequantized here, at load, with
        their scale into a float32 ``weight``; everything else passes through."""
        pending: dict[str, dict[str, Any]] = {}
        for file, name, source in tensors:
            module, _, leaf = name.rpartition(".")
            if module in self.quantized or leaf not in ("weight", "weight_scale_inv", "weight_scale"):
                yield file, name, source
                continue
            if leaf == "weight" and not _is_fp8(source):
                yield file, name, source
                continue
            parts = pending.setdefault(module, {})
            parts[leaf] = source
            if "weight" in parts and len(parts) == 2:
                del pending[module]
                yield file, f"{module}.weight", self._dequantize(parts)
        if pending:
            module, parts = next(iter(pending.items()))
            raise ValueError(f"fp8 checkpoint: {module} has {', '.join(sorted(parts))} without its "
                             f"{'scale' if 'weight' in parts else 'fp8 weight'}")

    def _dequantize(self, parts: dict[str, Any]) -> torch.Tensor:
        from pagoda.layers.linear import full

        w = full(parts.pop("weight")).to(torch.float32)
        scale = full(next(iter(parts.values()))).to(torch.float32)
        if self.block is None or scale.numel() == 1:
            return w * scale.reshape(())
        bn, bk = self.block
        rows = scale.repeat_interleave(bn, dim=0)[: w.shape[0]]
        return w * rows.repeat_interleave(bk, dim=1)[:, : w.shape[1]]

    def __repr__(self) -> str:
        return f"Fp8CheckpointConfig(weight_block_size={list(self.block) if self.block else None})"


class DenseLinear(QuantLinear):
    """A weight dequantized once into the model dtype, multiplied like an unquantized layer's
    (oneDNN-packed on CPU by the model runner through the method's ``pack_weight``)."""

    kernel = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.packed = weight.contiguous(), None

    def pack(self) -> bool:
        from pagoda.layers import cpu_gemm

        if self.packed is None and self.weight.device.type == "cpu":
            self.packed = cpu_gemm.pack(self.weight)
            if self.packed is not None:
                self.weight = torch.empty(0, dtype=self.weight.dtype)
        return self.packed is not None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.layers import cpu_gemm

        return cpu_gemm.linear(x, self.weight, self.packed, bias)


class _Fp8Method(LinearMethod):
    """What the fp8 methods share: where the weight ends up once loaded."""

    def finish(self, layer: nn.Module, dequantize: Any, tensors: tuple[torch.Tensor, ...],
               row_scales: torch.Tensor | None = None, block_width: int | None = None) -> None:
        """``row_scales``: one scale per output feature, where the weight has them; ``block_width``:
        the K width of a block-scaled weight's blocks (``tensors[1]`` its per-row, per-block
        scales). Such weights multiply in fp8 (W8A8) where ``fp8_w8a8.matmul_mode`` chooses it."""
        if row_scales is not None:
            w8a8 = w8a8_linear(tensors[0], row_scales)
        elif block_width is not None:
            w8a8 = block_w8a8_linear(tensors[0], tensors[1], block_width)
        else:
            w8a8 = None
        if w8a8 is not None:
            layer.qlinear = w8a8
        elif tensors[0].device.type == "cpu":
            layer.qlinear = DenseLinear(dequantize(layer.fp8_dtype))
        else:
            layer.qlinear = DequantLinear(dequantize, tensors)

    def pack_weight(self, layer: nn.Module) -> bool:
        qlinear = getattr(layer, "qlinear", None)
        return isinstance(qlinear, DenseLinear) and qlinear.pack()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.qlinear(x, bias)


def _is_fp8(source: Any) -> bool:
    if isinstance(source, torch.Tensor):
        return source.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return source.get_dtype() in ("F8_E4M3", "F8_E5M2")


def _add_fp8_weight(layer: nn.Module, in_features: int, out_features: int, weight_loader: WeightLoader) -> None:
    new_parameter(layer, "weight", (out_features, in_features), torch.float8_e4m3fn, weight_loader,
                  output_dim=0, input_dim=1)


class Fp8BlockMethod(_Fp8Method):
    """Block-scaled fp8; ``scale_name`` is ``weight_scale_inv`` (DeepSeek) or ``weight_scale``
    (compressed-tensors' block strategy)."""

    def __init__(self, block: tuple[int, int], scale_name: str) -> None:
        self.block, self.scale_name = block, scale_name

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        bn, bk = self.block
        if is_row_parallel(layer) and layer.tp_size > 1 and in_features % bk:
            raise ValueError(f"fp8: {layer.prefix} has {in_features} input features per rank, which splits its "
                             f"blocks of {bk}; a tensor-parallel size that splits a block is not supported")

        def load_scale(param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
            # One row per output feature, so that any split of the outputs is a split of rows.
            from pagoda.layers.linear import full

            rows = full(source).to(torch.float32).repeat_interleave(bn, dim=0)
            weight_loader(param, rows, shard_id)

        _add_fp8_weight(layer, in_features, out_features, weight_loader)
        new_parameter(layer, self.scale_name, (out_features, -(-in_features // bk)), torch.float32, load_scale,
                      output_dim=0, input_dim=1)
        layer.fp8_dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        w8, scales = layer.weight.data, getattr(layer, self.scale_name).data
        bk = self.block[1]
        out, inp = w8.shape

        def dequantize(dtype: torch.dtype) -> torch.Tensor:
            w = w8.to(torch.float32)
            if inp % bk == 0:
                w = (w.view(out, inp // bk, bk) * scales[:, :, None]).view(out, inp)
            else:
                w = w * scales.repeat_interleave(bk, dim=1)[:, :inp]
            return w.to(dtype)

        self.finish(layer, dequantize, (w8, scales), block_width=bk)
        del layer.weight
        delattr(layer, self.scale_name)


class Fp8TensorMethod(_Fp8Method):
    """fp8 with one scale per checkpoint tensor (a fused layer holds one per projection)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        _add_fp8_weight(layer, in_features, out_features, weight_loader)
        shards = len(output_partition_sizes)

        def load_scale(param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
            from pagoda.layers.linear import full

            value = full(source).to(torch.float32)
            if value.numel() != 1:
                raise ValueError(f"expected one per-tensor weight_scale, got shape {tuple(value.shape)}")
            param.data[shard_index(shard_id)] = value.reshape(())

        new_parameter(layer, "weight_scale", (shards,), torch.float32, load_scale)
        layer.fp8_sizes, layer.fp8_dtype = list(output_partition_sizes), dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        sizes = torch.tensor(layer.fp8_sizes, device=layer.weight.device)
        rows = layer.weight_scale.data.repeat_interleave(sizes)  # one scale per output feature
        self.finish(layer, _per_row(layer.weight.data, rows), (layer.weight.data, rows), rows)
        del layer.weight, layer.weight_scale


class Fp8ChannelMethod(_Fp8Method):
    """fp8 with one scale per output feature (``weight_scale`` ``[out, 1]``)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        _add_fp8_weight(layer, in_features, out_features, weight_loader)
        new_parameter(layer, "weight_scale", (out_features, 1), torch.float32, weight_loader,
                      output_dim=0, input_dim=None)
        layer.fp8_dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        rows = layer.weight_scale.data.reshape(-1)
        self.finish(layer, _per_row(layer.weight.data, rows), (layer.weight.data, rows), rows)
        del layer.weight, layer.weight_scale


def _per_row(w8: torch.Tensor, scales: torch.Tensor) -> Any:
    s = scales.to(torch.float32).reshape(-1, 1)
    return lambda dtype: (w8.to(torch.float32) * s).to(dtype)
