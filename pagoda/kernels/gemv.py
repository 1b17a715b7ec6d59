"""The few-row (decode) matrix-vector kernel (csrc/gemv.h, gemv.cpp) from Python.

A batch-1 decode step multiplies one row of activations by every weight of the model: the work
is one pass over the weights, so its speed is the memory bandwidth. The blocked GEMM kernels of
BLAS and oneDNN are built for many rows; at one row they pay packing, blocking and dispatch costs
that leave a large share of the bandwidth unused. This kernel streams each weight row once, in
the checkpoint's own ``[out, in]`` layout, computing up to ``MAX_ROWS`` activation rows from the
same load, and splits the output features across the OpenMP threads. float32 and bfloat16
weights (bfloat16 widened to float32 in registers; the sums are float32 either way).

Where the kernel library is unavailable or ``PAGODA_CPU_KERNELS=0`` the module reports itself unavailable
and the callers keep their other kernels.
"""
from __future__ import annotations

import torch

from pagoda.kernels.build import Kernel

MAX_ROWS = 4  # activation rows one pass over the weights serves

_KERNEL = Kernel("gemv", "CPU gemv kernel", "the other kernels serve every shape")


def load() -> object | None:
    """The kernel library's op namespace, or None when the kernel cannot run here."""
    return _KERNEL.load()


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16) and load() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most ``MAX_ROWS`` rows (leading dims
    flattened), in ``x``'s dtype."""
    ops = load()
    assert ops is not None
    flat = x.reshape(-1, x.shape[-1])
    y = ops.gemv(flat, weight)  # type: ignore[attr-defined]
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
