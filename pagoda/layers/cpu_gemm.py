"""Linear layers on CPU through oneDNN with weights packed once at start-up.

``torch.nn.functional.linear`` on a CPU float32 tensor calls the BLAS library torch was built
with. oneDNN (shipped inside torch) can instead multiply by a weight that was reordered once into
its own blocked layout, which skips the per-call packing a BLAS gemm does and picks kernels for
the CPU it runs on. For the shapes of a serving step (a few to a few hundred tokens times a
768-4096 wide weight) this is 2-4x faster than the BLAS call on the 2-core AMD machines pagoda is
developed on, and a row's result does not depend on how many other rows are in the batch.

``PAGODA_CPU_GEMM=torch`` turns packing off (every layer then calls ``F.linear``);
``PAGODA_CPU_GEMM=onednn`` makes a missing oneDNN an error instead of a silent fallback.
``pagoda bench gemm --model DIR`` times both on the model's shapes.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ENV_VAR = "PAGODA_CPU_GEMM"
_CHOICES = ("auto", "onednn", "torch")


def mode() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(_CHOICES)}")
    return value


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or ``None`` where oneDNN cannot take this dtype here
    (float16 needs AVX512-FP16 or AVX-NE-CONVERT, for example)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:
        return None


def pack_parameter(weight: nn.Parameter, keep_dense: bool) -> torch.Tensor | None:
    """Pack a CPU layer's weight; unless ``keep_dense`` (another module reads it, as a tied
    embedding does), drop the dense copy so the weights are not held twice. ``None`` where
    nothing was packed: not on CPU, or oneDNN cannot take it."""
    if weight.device.type != "cpu":
        return None
    packed = pack(weight.data)
    if packed is not None and not keep_dense:
        weight.data = torch.empty(0, dtype=weight.dtype)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one."""
    if packed is not None:
        return _LINEAR(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


# The resolved overload, so a call skips the op-namespace lookup (tens of calls per step).
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if onednn_available() else None


def pack_model(model: nn.Module) -> int:
    """Pack every linear layer of ``model`` that supports it (those with a ``pack_weight``
    method). Returns how many were packed; 0 when packing is off or oneDNN is missing."""
    choice = mode()
    if choice == "torch":
        return 0
    if not onednn_available():
        if choice == "onednn":
            raise RuntimeError(f"{ENV_VAR}=onednn but this torch build has no oneDNN linear ops")
        return 0
    layers = [m for m in model.modules() if hasattr(m, "pack_weight")]
    packed = sum(1 for layer in layers if layer.pack_weight())
    if packed < len(layers):
        logger.info("oneDNN packed %d of %d linear layers; the rest use torch's gemm", packed, len(layers))
    if choice == "onednn" and packed == 0 and layers:
        raise RuntimeError(f"{ENV_VAR}=onednn but oneDNN cannot pack this model's weights")
    return packed
