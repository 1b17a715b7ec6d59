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

On CPUs with AMX-BF16 a bfloat16 layer may instead keep its weight in ``cpu_amx``'s tile
layout for one to 16 or ``cpu_amx.MAX_ROWS`` rows (a batched decode step): chosen, per shape,
where that kernel beats oneDNN at 16 rows and whatever would serve one row (the gemv kernel or
oneDNN), and then the dense copy is dropped, so no weight is held more than twice
(``choose_amx``).

``PAGODA_CPU_GEMM=torch`` turns packing off (every layer then calls ``F.linear``);
``PAGODA_CPU_GEMM=onednn`` packs and never uses the gemv or AMX kernels, and makes a missing
oneDNN an error instead of a silent fallback; ``PAGODA_CPU_GEMM=gemv`` uses the gemv kernel for
every few-row product without timing; ``PAGODA_CPU_GEMM=amx`` uses the AMX kernel for every
bfloat16 product of up to ``cpu_amx.MAX_ROWS`` rows without timing (an error where it cannot
run). ``pagoda bench gemm --model DIR`` times the kernels on the model's shapes.
"""
from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import cpu_amx, cpu_gemv

logger = logging.getLogger(__name__)

ENV_VAR = "PAGODA_CPU_GEMM"
_CHOICES = ("auto", "onednn", "torch", "gemv", "amx")


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
    amx = choose_amx(weight.data, packed, use_gemv)
    if amx is not None:  # read by ``linear`` and the fused decode blocks
        packed.pagoda_amx, packed.pagoda_amx_rows = amx  # type: ignore[attr-defined]
        packed.pagoda_out = weight.shape[0]  # type: ignore[attr-defined]
        use_gemv = False
    if use_gemv:
        packed.pagoda_gemv = True  # type: ignore[attr-defined]  # read by ``linear``
    elif not keep_dense:
        weight.data = torch.empty(0, dtype=weight.dtype)
    return packed


# (out, in, dtype) -> whether the gemv kernel beat oneDNN at one row, measured once per process.
_GEMV_CHOICE: dict[tuple[int, int, torch.dtype], bool] = {}


# Bytes of weight copies the choice is timed over, so that each copy comes from memory.
_COLD_BYTES = 96 << 20


def cold_copies(weight: torch.Tensor) -> int:
    """How many copies of ``weight`` pass ``_COLD_BYTES``: timed in turn, each comes from memory,
    as a serving step's weights do."""
    return min(128, max(1, -(-_COLD_BYTES // (weight.numel() * weight.element_size()))))


def _best_of(fns: dict, rounds: int, per: int) -> dict[str, float]:
    """Best seconds per product of each function (interleaved rounds; a call runs ``per``)."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) / per)
    return best


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
        copies = cold_copies(weight)
        weights = [weight.data] + [weight.data.clone() for _ in range(copies - 1)]
        packs = [packed] + [pack(w) for w in weights[1:]]
        x = torch.randn(1, weight.shape[1]).to(weight.dtype)
        # The two are often within 10% on large weights: 7 rounds, enough to tell.
        best = _best_of({"gemv": lambda: [cpu_gemv.gemv(x, w, None) for w in weights],
                         "onednn": lambda: [_LINEAR(x, p, None, "none", [], "") for p in packs]}, 7, copies)
        del weights, packs
        # Ties go to the gemv kernel: inside a decode step there is no dispatcher and no
        # per-call primitive lookup in front of it.
        _GEMV_CHOICE[key] = best["gemv"] < 1.05 * best["onednn"]
        logger.debug("few-row kernel for %s %s: %s (gemv %.1f us, oneDNN %.1f us, %d copies)", tuple(weight.shape),
                     weight.dtype, "gemv" if _GEMV_CHOICE[key] else "oneDNN",
                     best["gemv"] * 1e6, best["onednn"] * 1e6, copies)
    return _GEMV_CHOICE[key]


# (out, in) -> up to how many rows the AMX kernel serves a bfloat16 weight of that shape (0: it
# does not), measured once per process.
_AMX_CHOICE: dict[tuple[int, int], int] = {}


def choose_amx(weight: torch.Tensor, packed: torch.Tensor, use_gemv: bool) -> tuple[torch.Tensor, int] | None:
    """The weight in ``cpu_amx``'s layout and up to how many rows (16 or ``cpu_amx.MAX_ROWS``)
    that kernel should serve this bfloat16 layer's products, else None. Always (every row count
    up to ``MAX_ROWS``) with ``PAGODA_CPU_GEMM=amx``, an error where the kernel cannot run; never
    with ``onednn``/``gemv``/``torch``. By default, timed as ``choose_gemv`` times (weights from
    memory, best of interleaved rounds): where it beats oneDNN at 16 rows and is within 5% of the
    one-row kernel it replaces (the gemv kernel where that was chosen, else oneDNN), since the
    layer then drops its dense copy; up to ``MAX_ROWS`` rows where it also beats oneDNN there,
    else up to 16. (On the 2-vCPU development VM, whose two threads share one core's AMX unit,
    the kernel leads at 2-16 rows and is level with oneDNN at 32.)"""
    choice = mode()
    if weight.dtype != torch.bfloat16 or choice in ("onednn", "gemv", "torch"):
        return None
    if choice == "amx":
        if not cpu_amx.supports(weight):
            raise RuntimeError(f"{ENV_VAR}=amx but the AMX kernel cannot run here (needs AMX-BF16 and a compiler for it)")
        return cpu_amx.pack(weight), cpu_amx.MAX_ROWS
    if not cpu_amx.supports(weight):
        return None
    key = (weight.shape[0], weight.shape[1])
    if _AMX_CHOICE.get(key) == 0:
        return None
    tiles = cpu_amx.pack(weight)
    if key not in _AMX_CHOICE:
        copies = cold_copies(weight)
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        packs = [packed] + [pack(w) for w in weights[1:]]
        amx = [tiles] + [cpu_amx.pack(w) for w in weights[1:]]
        module, n, k = cpu_amx.load(), weight.shape[0], weight.shape[1]
        xs = {m: torch.randn(m, k).to(torch.bfloat16) for m in (1, 16, cpu_amx.MAX_ROWS)}

        def on_amx(x: torch.Tensor):
            return lambda: [module.linear(x, t, n) for t in amx]  # type: ignore[union-attr]

        def on_onednn(x: torch.Tensor):
            return lambda: [_LINEAR(x, p, None, "none", [], "") for p in packs]

        fns = {f"amx{m}": on_amx(x) for m, x in xs.items()}
        fns.update({f"onednn{m}": on_onednn(x) for m, x in xs.items() if m > 1})
        fns["one"] = ((lambda: [cpu_gemv.gemv(xs[1], w, None) for w in weights]) if use_gemv else on_onednn(xs[1]))
        best = _best_of(fns, 7, copies)
        del weights, packs, amx
        top = cpu_amx.MAX_ROWS
        rows = 0
        if best["amx16"] < best["onednn16"] and best["amx1"] < 1.05 * best["one"]:
            rows = top if best[f"amx{top}"] < best[f"onednn{top}"] else 16
        _AMX_CHOICE[key] = rows
        logger.debug("AMX kernel for %s: up to %d rows (us, AMX / other: 1 row %.1f / %.1f, 16 rows %.1f / %.1f, "
                     "%d rows %.1f / %.1f)", key, rows, best["amx1"] * 1e6, best["one"] * 1e6, best["amx16"] * 1e6,
                     best["onednn16"] * 1e6, top, best[f"amx{top}"] * 1e6, best[f"onednn{top}"] * 1e6)
    return (tiles, _AMX_CHOICE[key]) if _AMX_CHOICE[key] else None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one, through the
    AMX kernel for as many rows as the layer chose it for, and through the
    gemv kernel for at most ``cpu_gemv.MAX_ROWS`` rows where that layer chose it."""
    if packed is not None:
        tiles = getattr(packed, "pagoda_amx", None)
        if tiles is not None and 0 < x.numel() <= packed.pagoda_amx_rows * x.shape[-1]:
            return cpu_amx.linear(x, tiles, packed.pagoda_out, bias)
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
