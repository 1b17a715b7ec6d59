"""The weight-quantization seam: a ``QuantizationConfig`` chooses, per linear layer, a
``LinearMethod`` that owns that layer's parameters and its matmul.

Contract
========

``QuantizationConfig`` (one per model, built once by ``get_quantization_config``)
    ``name`` is the method (``int8``, ``int4``, ``fp8``, or a checkpoint format). It is built
    either from ``--quantization`` (online quantization of a float checkpoint, with optional
    ``--quantization-config`` JSON options) or from the checkpoint's own
    ``quantization_config`` (``from_checkpoint=True``). ``get_linear_method(layer, prefix)``
    returns the method for the layer named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``),
    or ``None`` to keep the layer unquantized. Embeddings and the LM head are never asked
    unless a config opts in.

``LinearMethod`` (one per layer; stateless apart from what it stores on the layer)
    ``create_weights(layer, in_features, out_features, output_partition_sizes, dtype,
    weight_loader)`` registers the layer's parameters. Sizes are THIS RANK's: ``in_features``
    is already divided by the tensor-parallel size for a row-parallel layer, ``out_features``
    for a column-parallel one, and ``output_partition_sizes`` lists the fused projections
    (q, k, v or gate, up) as this rank holds them. Every parameter gets ``weight_loader``
    (the layer's own: it does the tensor-parallel sharding) plus attributes that tell the
    loader how the tensor is laid out (set with ``set_weight_attrs``):

    - ``output_dim``: the dimension indexing output features (column-parallel layers shard
      it; fused layers place each checkpoint projection along it). ``None``: not along the
      output, the tensor is copied whole.
    - ``input_dim``: the dimension indexing input features or input groups (row-parallel
      layers shard it). ``None``: copied whole on every rank (a per-channel scale, a bias).
    - ``packed_dim`` / ``pack_factor``: that dimension stores ``pack_factor`` logical
      elements per stored element (eight 4-bit values per int32), so offsets along it are
      divided by the factor.
    - ``per_shard``: the tensor has one entry per fused projection (a per-tensor scale of
      q, k and v); the loader writes the checkpoint scalar at the projection's index.
    - ``optional``: the checkpoint may omit it (the loader does not report it missing).

    The checkpoint names are the layer's name plus the parameter's attribute name
    (``...qkv_proj.qweight`` gathers ``q_proj.qweight``, ``k_proj.qweight``, ``v_proj.qweight``).
    A row-parallel layer's input groups must not straddle ranks: a method that uses groups
    checks ``in_features % group_size == 0`` for this rank's ``in_features``.

    ``process_weights_after_loading(layer)`` runs once, after every parameter is loaded and
    before the first forward: quantize float weights (online methods), repack into a kernel's
    layout, drop what is no longer needed.

    ``apply(layer, x, bias)`` returns ``x @ W.T + bias`` in ``x``'s dtype for ``x`` of shape
    ``[tokens, in_features]``. Row-parallel layers pass ``bias=None`` and add it after the
    all-reduce.

Kernels both online and checkpoint methods target live in ``kernels.py``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn

WeightLoader = Callable[..., None]


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach layout attributes (``output_dim``, ``input_dim``, ``weight_loader``, ...)."""
    for key, value in attrs.items():
        if hasattr(param, key) and key != "weight_loader":
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def new_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  weight_loader: WeightLoader, **attrs: Any) -> nn.Parameter:
    """Register an empty, frozen parameter ``name`` on ``layer`` with its loader and layout."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, {"weight_loader": weight_loader, **attrs})
    layer.register_parameter(name, param)
    return param


class LinearMethod(ABC):
    """How one linear layer stores its weight and multiplies by it (see the module docstring)."""

    # Whether every parameter's checkpoint tensor holds exactly the layer's extents (all ranks'
    # parts together): the layer's loader then refuses a tensor of any other shape (a config that
    # disagrees with its weights). False for layouts whose scales may be padded to whole blocks.
    exact_extents = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Default: the loaded parameters are used as they are."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def pack_weight(self, layer: nn.Module) -> bool:
        """Move the weight into oneDNN's layout (CPU); False where the method has its own
        kernel layout (quantized methods) or oneDNN cannot take it."""
        return False


class UnquantizedLinearMethod(LinearMethod):
    """A dense ``[out, in]`` weight in the model dtype; on CPU packed once for oneDNN
    (``cpu_gemm``) by the model runner, exactly the layers' behaviour before quantization."""

    exact_extents = True

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        new_parameter(layer, "weight", (out_features, in_features), dtype, weight_loader,
                      output_dim=0, input_dim=1)
        layer.packed = None  # the weight in oneDNN's layout once packed

    def pack_weight(self, layer: nn.Module) -> bool:
        from pagoda.layers import cpu_gemm

        if layer.packed is None:
            layer.packed = cpu_gemm.pack_parameter(layer.weight, keep_dense=False)
        return layer.packed is not None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.layers import cpu_gemm, skinny_gemm

        if x.is_cuda:  # a few rows: cuBLAS or the Triton kernel, whichever measured faster
            return skinny_gemm.linear(x, layer.weight, bias)
        return cpu_gemm.linear(x, layer.weight, layer.packed, bias)


class QuantizationConfig(ABC):
    """One model's quantization: its name and, per layer, the linear method."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "QuantizationConfig":
        """Build from the checkpoint's ``quantization_config`` (``from_checkpoint``) or the
        user's ``--quantization-config`` options; raise ``ValueError`` naming anything
        unsupported."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the linear layer named ``prefix``; ``None`` keeps it unquantized."""

    def get_lm_head_method(self) -> LinearMethod | None:
        """The method for the LM head; ``None`` (the default) keeps it in the model dtype."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
