"""A float32 matmul over weights packed into 16-column panels, for the decode shapes (one to a few
dozen rows), run where the CPU has AVX-512 or AVX2 with FMA (csrc/panel.cpp, avx512 and avx2
variants).

Why: a float32 decode step multiplies each weight by one row per sequence. At one to 32 rows
that is a pass over the weights with little arithmetic per byte, and neither of the other
kernels streams it well: oneDNN's blocked float32 kernels, built for large products, ran at 14-60
GFLOP/s at 2-8 rows and 115-140 at 32 on the 2-core Xeon pagoda is developed on (weights from
memory, ``pagoda bench gemm``), and the gemv kernel reads the ``[out, in]`` weight as dot
products that end in a horizontal sum per output.

Here the weight is packed once as ``[ceil(N/16), K, 16]`` float32 (zero padded): panel ``p``
holds output features ``16p .. 16p+15``, and step ``k`` of a panel is the sixteen weights that
input ``k`` contributes to them, one 64-byte line. A tile of up to eight rows and three panels
(48 features) keeps its 24 accumulators in registers; each step loads three weight vectors and
multiplies each by the eight rows' input ``k``, broadcast. Every thread takes one contiguous
run of panels, so it streams its share of the weights front to back; the first row tile of a
group of panels fetches the lines it will read a few dozen steps on, and with more than eight
rows the second tile fetches the next group into L2 while the rest of the rows reuse the current
one from cache. Each output sums its ``K`` products in order with fused multiply-adds, so a
row's result does not depend on the other rows of the step.

Measured on that Xeon against the previous kernels over the 56M-parameter model's shapes
(weights from memory): 1.14-1.26x the gemv kernel at one row, 1.3-1.8x oneDNN at 2-16 rows,
1.1-1.4x at 32, level at 48-64 (so it serves at most ``MAX_ROWS``). The AVX2 code has sixteen
8-lane registers: one row takes three panels at a time, more rows one panel and six rows at a
time; each output's sum is the same in-order chain, so its results equal AVX-512's bit for bit.
In the scalar variant ``supported()`` is False and the other kernels keep serving (``cpu_gemm``
times the panels against them per shape either way).

Bfloat16 weights have the same kernel for CPUs with AVX512-BF16 but no AMX (AMD EPYC Zen 4, for
one): panels ``[ceil(N/16), ceil(K/2), 16, 2]`` (a step is a pair of K values, still one 64-byte
line), the rows rounded to bfloat16 pairs, each step's two products per feature added by
``vdpbf16ps`` (exact products, float32 sums in a fixed order). Where AMX is there, ``cpu_amx``
serves bfloat16 instead: on the Xeon the two are level at one row, and AMX is 1.5-4x faster from
eight rows up; this kernel is 1.3-1.5x the bfloat16 gemv kernel at one row there.
"""
from __future__ import annotations

import torch

from pagoda.kernels.build import Kernel, packed_linear

MAX_ROWS = 32  # the most rows the kernel serves (oneDNN's blocking is level at 48-64 rows)


_KERNEL = Kernel("panel", "CPU float32 panel kernel", "oneDNN and the gemv kernel serve float32 decode rows")


def load() -> object | None:
    """The kernel library's op namespace, or None where the kernel cannot run here."""
    return _KERNEL.load()


def supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this process can run the kernel for ``dtype`` weights: the avx2 or avx512 variant
    for float32, AVX512-BF16 for bfloat16."""
    ops = load()
    if ops is None or dtype not in (torch.float32, torch.bfloat16):
        return False
    return bool(ops.panel_available() if dtype == torch.float32 else ops.panel_available_bf16())  # type: ignore[attr-defined]


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and supported(weight.dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] float32 or bfloat16) in the kernel's layout."""
    ops = load()
    return ops.panel_pack_bf16(weight) if weight.dtype == torch.bfloat16 else ops.panel_pack(weight)  # type: ignore[union-attr]


def linear_op():
    """The kernel's op itself: ``linear_op()(rows, packed, out_features)``, float32 ``[rows, out]``."""
    return load().panel_linear  # type: ignore[union-attr]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight, in ``x``'s dtype."""
    return packed_linear(linear_op(), x, packed, out_features, bias)
