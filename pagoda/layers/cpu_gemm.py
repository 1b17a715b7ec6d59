"""Linear layers on CPU through oneDNN with weights packed once at start-up.

``torch.nn.functional.linear`` on a CPU float32 tensor calls the BLAS library torch was built
with. oneDNN (shipped inside torch) can instead multiply by a weight that was reordered once into
its own blocked layout, which skips the per-call packing a BLAS gemm does and picks kernels for
the CPU it runs on. For the shapes of a serving step (a few to a few hundred tokens times a
768-4096 wide weight) this is 2-4x faster than the BLAS call on the 2-core AMD machines pagoda is
developed on, and a row's result does not depend on how many other rows are in the batch.

At one to four rows (a decode step of up to four sequences) the work is a pass over the
weights, and oneDNN's and BLAS's blocked kernels leave much of the memory bandwidth unused there.
``cpu_gemv`` streams the plain ``[out, in]`` weight instead. Which kernel serves the few-row
products of a layer is chosen at start-up, per weight shape and dtype, by timing both on this
machine (``choose_gemv``); where the gemv kernel wins the layer keeps its dense weight beside
the packed one (the packed one still serves more rows), else the dense copy is dropped.

``PAGODA_CPU_GEMM=torch`` turns packing off (every layer then calls ``F.linear``);
``PAGODA_CPU_GEMM=onednn`` packs and never uses the gemv kernel, and makes a missing oneDNN an
error instead of a silent fallback; ``PAGODA_CPU_GEMM=gemv`` uses the gemv kernel for every
few-row product without timing. ``pagoda bench gemm --model DIR`` times the kernels on the
model's shapes.
"""
from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import cpu_gemv

logger = logging.getLogger(__name__)

ENV_VAR = "PAGODA_CPU_GEMM"
_CHOICES = ("auto", "onednn", "torch", "gemv")


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
    embedding does) or the gemv kernel serves this layer's few-row products, drop the dense
    copy so the weights are not held twice. ``None`` where nothing was packed: not on CPU, or
    oneDNN cannot take it."""
    if weight.device.type != "cpu":
        return None
    packed = pack(weight.data)
    if packed is None:
        return None
    use_gemv = choose_gemv(weight.data, packed)
    if use_gemv:
        packed.pagoda_gemv = True  # type: ignore[attr-defined]  # read by ``linear``
    elif not keep_dense:
        weight.data = torch.empty(0, dtype=weight.dtype)
    return packed


# (out, in, dtype) -> whether the gemv kernel beat oneDNN at one row, measured once per process.
_GEMV_CHOICE: dict[tuple[int, int, torch.dtype], bool] = {}


# Bytes of weight copies the choice is timed over, so that each copy comes from memory.
_COLD_BYTES = 96 << 20


def choose_gemv(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether few-row products with ``weight`` should use the gemv kernel: always with
    ``PAGODA_CPU_GEMM=gemv``, never with ``onednn``; by default when it is faster than the
    packed oneDNN product at one row on this machine, or within 5% of it.

    Both are timed as a decode step runs them: on weights that come from memory (every weight
    of the model streams through the caches between two uses of one). A copy of a small weight
    would stay in cache when timed alone, where oneDNN's blocked kernels (AMX on Intel Xeons)
    look better than they are in a step, so enough copies to pass ``_COLD_BYTES`` are timed in
    turn (transient memory, at start-up only); best of interleaved rounds, which is the figure
    least disturbed by other load."""
    choice = mode()
    if choice in ("onednn", "torch") or not cpu_gemv.supports(weight):
        return False
    if choice == "gemv":
        return True
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    if key not in _GEMV_CHOICE:
        nbytes = weight.numel() * weight.element_size()
        copies = min(128, max(1, -(-_COLD_BYTES // nbytes)))
        weights = [weight.data] + [weight.data.clone() for _ in range(copies - 1)]
        packs = [packed] + [pack(w) for w in weights[1:]]
        x = torch.randn(1, weight.shape[1]).to(weight.dtype)

        def gemv_all() -> None:
            for w in weights:
                cpu_gemv.gemv(x, w, None)

        def onednn_all() -> None:
            for p in packs:
                _LINEAR(x, p, None, "none", [], "")

        gemv_s, packed_s = [], []
        for _ in range(7):  # the two are often within 10% on large weights: enough rounds to tell
            for fn, times in ((gemv_all, gemv_s), (onednn_all, packed_s)):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) / copies)
        del weights, packs
        # Ties go to the gemv kernel: inside a decode step there is no dispatcher and no
        # per-call primitive lookup in front of it.
        _GEMV_CHOICE[key] = min(gemv_s) < 1.05 * min(packed_s)
        logger.debug("few-row kernel for %s %s: %s (gemv %.1f us, oneDNN %.1f us, %d copies)", tuple(weight.shape),
                     weight.dtype, "gemv" if _GEMV_CHOICE[key] else "oneDNN",
                     min(gemv_s) * 1e6, min(packed_s) * 1e6, copies)
    return _GEMV_CHOICE[key]


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one, and through
    the gemv kernel for at most ``cpu_gemv.MAX_ROWS`` rows where that layer chose it."""
    if packed is not None:
        if 0 < x.numel() <= cpu_gemv.MAX_ROWS * x.shape[-1] and getattr(packed, "pagoda_gemv", False):
            return cpu_gemv.gemv(x, weight, bias)
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
