"""A bfloat16 matmul on Intel AMX tiles for the batched-decode shapes (a few to a few dozen rows),
run where the CPU has AMX-BF16 (csrc/amx.cpp, in the avx512 kernel variant).

Why: a decode step of 8-64 sequences multiplies each weight by a few dozen rows. That is still a
pass over the weights (the arithmetic is small next to the bytes), and oneDNN's bfloat16 kernels,
built for large products, read L3-resident weights at 7-20 GB/s at those row counts on the 2-core
Xeon pagoda is developed on (``pagoda bench gemm``). Here the weight is packed once into the
layout an AMX tile multiply reads, 32 output features at a time, each block's ``K`` values
contiguous, so every thread streams its share of the weights front to back; the rows are
rounded to bfloat16 (as oneDNN does for a bfloat16 model) into tiles of 16, and each 16 x 16
block of outputs sums float32 products in one fixed order along ``K`` (a row's result does not
depend on the other rows of the step).

The layout: ``[ceil(N/32), ceil(K/32), 2, 16, 32]`` bfloat16, zero padded; tile ``t`` of block
``(n, k)`` holds output features ``32n + 16t ..`` and, per tile row, the pairs ``k, k+1`` of its
16 features side by side (the VNNI order ``TDPBF16PS`` takes).

Where AMX is missing (AMD EPYC, older Xeons), the level chosen is not ``amx`` (``PAGODA_CPU_ISA``),
the kernel library is unavailable or Linux refuses the tile state, ``supported()`` is False and
oneDNN keeps serving.
"""
from __future__ import annotations

import torch

from pagoda.kernels import select
from pagoda.kernels.build import Kernel, packed_linear

MAX_ROWS = 32  # the most rows the kernel serves (beyond, oneDNN's blocking wins: 0.6-0.9x at 64 rows)


_KERNEL = Kernel("amx", "CPU AMX bfloat16 kernel", "oneDNN serves bfloat16 batches",
                 supported=select.amx_allowed)


def load() -> object | None:
    """The kernel library's op namespace, or None where the kernel cannot run here."""
    return _KERNEL.load()


def supported() -> bool:
    """Whether this process can run the kernel: an AMX-BF16 CPU, a build that targets it, and
    the tile state granted by the kernel."""
    ops = load()
    return ops is not None and bool(ops.amx_available())  # type: ignore[attr-defined]


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] bfloat16) in the kernel's layout."""
    return load().amx_pack(weight)  # type: ignore[union-attr]


def linear_op():
    """The kernel's op itself: ``linear_op()(rows, packed, out_features)``, float32 ``[rows, out]``."""
    return load().amx_linear  # type: ignore[union-attr]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight, in ``x``'s dtype."""
    return packed_linear(linear_op(), x, packed, out_features, bias)
