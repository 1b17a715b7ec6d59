"""Quantized matmul kernels that every weight format targets.

A format's ``process_weights_after_loading`` turns its tensors into one of these objects and
stores it on the layer; ``apply`` calls it. All of them compute ``x @ W.T + bias`` where ``W``
is the dequantized ``[out, in]`` weight, in ``x``'s dtype:

- ``make_int4_linear``: 4-bit values 0..15 with per-group float scales and zero points,
  ``W[n, k] = scales[n, g] * (q[n, k] - zeros[n, g])`` (``g = k // group_size``; a group of
  the whole row is ``group_size = in_features``). An optional input-column permutation
  handles act-order checkpoints. On CPU this maps exactly onto torch's
  ``_weight_int4pack_mm_for_cpu``, whose dequantization is ``scale * (q - 8) + zero``: its zero
  is ``scale * (8 - zero_point)``, and a group size that is a multiple of one the op takes is
  split into equal sub-groups sharing the scale.
- ``make_int8_linear``: int8 values with a per-output-channel scale (``W = scales[:, None] * q``),
  on CPU ``_weight_int8pack_mm``; int8 with zero points (or grouped int8 where pagoda's kernel
  does not run) dequantizes on the fly.
- On AVX-512 CPUs with VNNI and bfloat16 dot products, all three (int8 per channel or in groups
  of up to 256 without zeros, int4 with a group size that is a multiple of 8, fp8 e4m3) go to
  pagoda's own compiled kernel
  (``cpu_woq.py``: integer dot products for int8/int4, bfloat16 ones for fp8), which beats
  both float32 and torch's ops at every batch size measured (``pagoda bench quantization``) and
  returns float32 outputs; on AVX2 CPUs (the avx2 kernel variant) int8 and int4 go to the same
  kernel's AVX2 code; torch's ops are the fallback where it cannot run.
- On CUDA, int8 and int4 go to a dequantizing Triton kernel (``triton_woq.py``).
- ``DequantLinear``: anything else (fp8, unsupported group sizes, GPUs): dequantize the whole
  weight in the activation dtype, then a dense matmul. Correct everywhere, fast nowhere; the
  fallback, not the plan.

CPU: torch's weight-only ops are vectorized for bfloat16 activations only (their float32 path is
10-100x slower), so a float32 ``x`` is rounded to bfloat16 on the way in and the output
converted back; the products accumulate in float32. That adds a relative error of at most
2**-9 per activation, below the weights' own quantization step.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pagoda.kernels import woq as cpu_woq
from pagoda.layers.quantization import triton_woq

# Group sizes _weight_int4pack_mm_for_cpu accepts.
INT4_CPU_GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 8  # the CPU pack ignores the tile count beyond validating it


def dequantize_grouped(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``scales[n, g] * (q[n, k] - zeros[n, g])`` as a dense ``[N, K]`` tensor of ``dtype``;
    ``zeros=None`` is symmetric (zero point 0). Scales of shape ``[N]`` mean one group per row."""
    n, k = q.shape
    if scales.dim() == 1:
        scales = scales[:, None]
        zeros = zeros[:, None] if zeros is not None else None
        group_size = k
    groups = k // group_size
    w = q.to(torch.float32).view(n, groups, group_size)
    if zeros is not None:
        w = w - zeros.to(torch.float32).view(n, groups, 1)
    w = w * scales.to(torch.float32).view(n, groups, 1)
    return w.view(n, k).to(dtype)


class QuantLinear:
    """A quantized weight ready for ``__call__(x, bias)``; ``nbytes`` is its memory."""

    kernel = ""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


class DequantLinear(QuantLinear):
    """Dequantize the weight on every call, then a dense matmul (the universal fallback)."""

    kernel = "dequant"

    def __init__(self, dequantize: Callable[[torch.dtype], torch.Tensor], tensors: tuple[torch.Tensor, ...],
                 perm: torch.Tensor | None = None) -> None:
        self._dequantize = dequantize
        self.tensors = tensors  # what ``dequantize`` reads, kept for ``nbytes``
        self.perm = perm

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x[..., self.perm]
        return F.linear(x, self._dequantize(x.dtype), bias)


def _cpu_compute(x: torch.Tensor) -> torch.Tensor:
    # float16 too: the int4 op's scales are bfloat16 (it raises on a float16 input), and its
    # float16 path is ~4x slower than bfloat16.
    return x.to(torch.bfloat16) if x.dtype in (torch.float32, torch.float16) else x


class Int4PackedCPU(QuantLinear):
    """``_weight_int4pack_mm_for_cpu`` over torch's packed layout."""

    kernel = "int4pack"

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                 out_features: int, perm: torch.Tensor | None) -> None:
        self.packed, self.scale_zeros, self.group_size = packed, scale_zeros, group_size
        self.out_features, self.perm = out_features, perm

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x[..., self.perm]
        lead = x.shape[:-1]
        x2 = _cpu_compute(x.reshape(-1, x.shape[-1]))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros)
        y = y.to(x.dtype).view(*lead, self.out_features)
        return y + bias if bias is not None else y


class Int8PackedCPU(QuantLinear):
    """``_weight_int8pack_mm``: int8 ``[N, K]`` with one scale per output channel."""

    kernel = "int8pack"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.q = q.contiguous()
        self.scales = scales.to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _cpu_compute(x.reshape(-1, x.shape[-1]))
        scales = self.scales if x2.dtype == torch.bfloat16 else self.scales.to(x2.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, scales).to(x.dtype)
        y = y.view(*lead, self.q.shape[0])
        return y + bias if bias is not None else y


def _int4_cpu_group(group_size: int, in_features: int) -> int | None:
    """A group size the CPU op takes that evenly splits ``group_size``; None if there is none."""
    if in_features % 2:
        return None
    for g in sorted(INT4_CPU_GROUP_SIZES, reverse=True):
        if group_size % g == 0 and in_features % g == 0:
            return g
    return None


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


# auto: pagoda's CPU kernel where it runs, Triton on CUDA, else torch's ops; the others force one
# (``triton`` also on CPU tensors, under TRITON_INTERPRET=1).
BACKENDS = ("auto", "torch", "dequant", "triton")


def _use_triton(backend: str, q: torch.Tensor) -> bool:
    if backend == "triton":
        return True
    return backend == "auto" and q.is_cuda and triton_woq.HAS_TRITON


def make_int4_linear(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                     perm: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                     backend: str = "auto") -> QuantLinear:
    """``q``: ``[N, K]`` integers 0..15 (any integer dtype, unpacked); ``scales``/``zeros``:
    ``[N, K // group_size]`` float (``zeros`` in the same units as ``q``: ``W = s * (q - z)``;
    None means 8, the symmetric midpoint). ``perm``: the kernel computes ``x[:, perm] @ W.T``,
    i.e. column ``j`` of ``q`` multiplies input column ``perm[j]`` (act-order). ``dtype``: the
    activations' dtype (for the fallback's scale precision). ``backend``: ``auto``, or force
    torch's op (``torch``, where it applies) or the dequantizing fallback (``dequant``).
    pagoda's CPU kernel holds each group's scale and ``-scale * zero`` in float16 (exact where
    they are float16 numbers, else rounded to nearest: ``cpu_woq.int4_group_terms``)."""
    _check_backend(backend)
    n, k = q.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide {k} input features")
    if zeros is None:
        zeros = torch.full_like(scales, 8.0)
    if _use_triton(backend, q) and k % 2 == 0:
        return triton_woq.TritonWoq(q, scales, zeros, group_size, 4, perm)
    terms = None
    if backend == "auto" and cpu_woq.usable(cpu_woq.KIND_INT4, n, k, q.device, group_size):
        s32 = scales.to(torch.float32)
        terms = cpu_woq.int4_group_terms(s32, -s32 * zeros.to(torch.float32))
    if terms is not None:  # the kernel: float16 group terms (exact where the source's are float16)
        return cpu_woq.WoqCPU(cpu_woq.KIND_INT4, cpu_woq.pack_int4(q), n, k, group_scale=terms[0],
                              group_bias=terms[1], group_size=group_size, perm=perm)
    cpu_group = _int4_cpu_group(group_size, k) if q.device.type == "cpu" and backend != "dequant" else None
    if cpu_group is None:
        qi = q.to(torch.uint8)
        return DequantLinear(lambda dt: dequantize_grouped(qi, scales, zeros, group_size, dt),
                             (qi, scales, zeros), perm)
    split = group_size // cpu_group
    s = scales.to(torch.float32).repeat_interleave(split, dim=1)
    z = zeros.to(torch.float32).repeat_interleave(split, dim=1)
    torch_zero = s * (8.0 - z)  # scale * (q - 8) + torch_zero == scale * (q - z)
    scale_zeros = torch.stack([s, torch_zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)
    return Int4PackedCPU(packed, scale_zeros, cpu_group, n, perm)


def make_int8_linear(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                     group_size: int = -1, perm: torch.Tensor | None = None, backend: str = "auto") -> QuantLinear:
    """``q``: ``[N, K]`` int8 (or integers in -128..127); ``scales``: ``[N]`` per channel, or
    ``[N, K // group_size]`` per group; ``zeros`` as ``scales`` (``W = s * (q - z)``) or None.
    pagoda's CPU kernel takes per-group scales without zeros (a group a multiple of 4 up to 256,
    GGUF Q8_0's 32) in float16 (exact where they are float16 numbers: ``cpu_woq.pack_int8g``)."""
    _check_backend(backend)
    n, k = q.shape
    per_channel = group_size in (-1, k) and zeros is None and perm is None
    if _use_triton(backend, q):
        g = k if group_size in (-1, k) else group_size
        return triton_woq.TritonWoq(q, scales.reshape(n, -1), zeros, g, 8, perm)
    if backend == "auto" and per_channel and cpu_woq.usable(cpu_woq.KIND_INT8, n, k, q.device):
        packed, row_sums = cpu_woq.pack_int8(q)
        return cpu_woq.WoqCPU(cpu_woq.KIND_INT8, packed, n, k, col_scale=scales.reshape(n), aux=row_sums)
    grouped = None
    if (backend == "auto" and not per_channel and zeros is None and perm is None
            and cpu_woq.usable(cpu_woq.KIND_INT8G, n, k, q.device, group_size)):
        grouped = cpu_woq.pack_int8g(q, scales.reshape(n, k // group_size))
    if grouped is not None:  # the kernel: float16 group scales (exact where the source's are float16)
        return cpu_woq.WoqCPU(cpu_woq.KIND_INT8G, grouped[0], n, k, group_scale=grouped[1], group_size=group_size)
    if per_channel and q.device.type == "cpu" and backend != "dequant":
        return Int8PackedCPU(q.to(torch.int8), scales.reshape(n))
    if group_size in (-1, k):
        group_size = k
        scales = scales.reshape(n, 1)
        zeros = zeros.reshape(n, 1) if zeros is not None else None
    if k % group_size:
        raise ValueError(f"int8 group size {group_size} does not divide {k} input features")
    qi = q.to(torch.int8)
    if per_channel:  # a GPU: one fused multiply by the per-channel scale
        s = scales.reshape(n, 1)
        return DequantLinear(lambda dt: qi.to(dt) * s.to(dt), (qi, s))
    return DequantLinear(lambda dt: dequantize_grouped(qi, scales, zeros, group_size, dt),
                         (qi, scales) + ((zeros,) if zeros is not None else ()), perm)


def make_fp8_linear(w: torch.Tensor, scales: torch.Tensor, backend: str = "auto") -> QuantLinear:
    """``w``: ``[N, K]`` float8 (e4m3 or e5m2); ``scales``: a scalar, ``[N]`` per channel or a
    ``[N, 1]`` column. Dequantized on the fly (no fp8 matmul is used)."""
    s = scales.to(torch.float32).reshape(-1, 1) if scales.numel() > 1 else scales.to(torch.float32).reshape(1, 1)
    _check_backend(backend)
    n, k = w.shape
    if backend == "auto" and w.dtype == torch.float8_e4m3fn and cpu_woq.usable(cpu_woq.KIND_FP8, n, k, w.device):
        return cpu_woq.WoqCPU(cpu_woq.KIND_FP8, cpu_woq.pack_fp8(w), n, k, col_scale=s.expand(n, 1).reshape(n))
    return DequantLinear(lambda dt: (w.to(torch.float32) * s).to(dt), (w, s))
