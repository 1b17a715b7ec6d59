"""C++ weight-only quantized matmuls (csrc/woq.cpp): int8 (one scale per output channel, or a
float16 scale per group of columns), int4 and fp8 in the avx512 kernel variant (integer dot
products, VNNI, and bfloat16 ones, ``avx512_bf16``); both int8 kinds and int4 in the avx2 variant
(``has_kind``), over the same packed layouts and activations.

Why: torch's weight-only CPU ops (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
are fast for one row but no faster than a float32 GEMM from about 8 rows on, their float32
path is 10-100x slower than their bfloat16 one, and they round outputs to bfloat16. A decode
step is one pass over the weights, so the kernel must spend fewer instructions per weight byte
than the memory delivers; converting each weight to a float first (as a dequantizing kernel
does) costs 5-7 instructions per 32 weights and left int8/int4 compute-bound at a third of the
bandwidth.

int8 and int4: integer dot products, no per-weight conversion. Each activation row is written
as 16-bit fixed point with one scale per row, ``x ~ sx * (256 * hi + lo)`` (error at most
``max|x| * 2**-16`` per element; a bfloat16 rounding is ``|x| * 2**-9``), split into two byte
planes, and ``vpdpbusd`` multiplies 64 weight bytes by 4 activation bytes per lane in one
instruction: per 64 int8 weights one load and two multiply-adds, per 128 int4 weights one load,
three bit operations to split the nibbles, and four multiply-adds. Sums are exact in int32
(per group of ``group_size`` columns for int4, after which the group's float scale is applied
once); int8's byte-plane offset (unsigned x signed operands) is undone with per-channel column
sums computed at packing time. Integer sums do not depend on order, and each row is quantized
on its own, so a row's result does not depend on the other rows of the batch.

int8 in groups (``KIND_INT8G``, GGUF Q8_0's numbers: int8 codes, a float16 scale per group of
32 or any multiple of 4 up to 256 columns and output channel; 1.0625 bytes a weight at 32): the
codes are stored as ``q + 128`` (``vpdpbusd``'s unsigned operand) and the activations are int4's
(signed byte planes, ``|v| <= 32639``, and each row's group sums of ``v``), so per group
``sum (q + 128) * v - 128 * sum v = sum q * v`` is exact in int32, rounded to float once and
multiplied by the group's scale; every path (AVX-512, AVX-VNNI, plain AVX2's 16-bit products)
computes the same integers and float operations, so they agree bit for bit. The only rounding
beyond float32's is the activations' 16-bit fixed point (int4's step, ``max|x| / 32639``, 0.4%
coarser than int8 per channel's). Before this kind a Q8_0 matrix ran as two int4 planes: 1.19
bytes a weight, two products, each row quantized twice.

int4 metadata (``int4_group_terms``): per group and output channel a float16 scale and a float16
zero term (``w = scale * q + term``), 4 bytes a group, so 0.625 bytes a weight in groups of 32
(float32 scales and terms and an int32 code sum per group had made it 0.875); symmetric codes
(every term ``-8 * scale``) keep only the scales, 0.5625 bytes a weight. The kernel
computes with the float16 values exactly: a source whose scales and terms are float16 numbers
(GGUF Q4_0, Q4_1 and Q8_0's blocks, symmetric GPTQ with float16 scales) is computed exactly as
before; others are rounded to float16 once (at most 2**-11 of each group's scale and term, or
2**-25 absolute below float16's normal range, 6.1e-5; e.g. GGUF Q4_K's ``d * sc`` and ``dmin * m``
products). A layer with a value beyond float16's range (65504) stays off the kernel. The
activation rows of int4 are 16-bit fixed point with ``|v| <= 32639`` (a step of ``max|x| /
32639``), split as ``v = 256 * hi + lo`` with both byte planes signed, which needs no code sums.

AVX2 (no vpdpbusd): the kinds turn the weights into 16-bit lanes with shifts and multiply them
by the 16-bit activations with ``vpmaddwd``. int4 sums each group exactly in int32 and rounds
that integer once, as the AVX-512 kernel's byte-plane sums do, so its results equal the avx512
variant's bit for bit (one row keeps the byte planes through ``vpmaddubsw``, the same sums);
int8 folds its int32 sums into float32 every 256 columns (exact up to K = 256, then one float32
rounding per 256 columns: within float32 rounding of the avx512 variant, the same activation
rounding).

AVX-VNNI (``avx_vnni``: Intel since Alder Lake, AMD since Zen 4): the avx2 variant takes
``vpdpbusd`` on 256-bit registers for every kind, the AVX-512 scheme at half width, so they
equal the avx512 variant's bits; chosen at run time (``select.avx_vnni()``,
``PAGODA_CPU_VNNI=0`` keeps the plain AVX2 code), since the variant is built for x86-64-v3.

fp8 (e4m3): every 16-output-channel block is dequantized into bfloat16 in the order
``vdpbf16ps`` consumes it (in registers for up to 4 rows, else into a scratch tile reused by 8
rows at a time); activations rounded to bfloat16; products accumulate in float32.

Weight layouts (``pack_*`` build them from ``[N, K]`` tensors; N a multiple of 16):
int8 ``[N/16][K/4][16][4]`` (K a multiple of 4; in groups, ``q + 128`` as uint8 in that order and
the scales float16 ``[N/16][G][16]``, each block's in one stream); int4 ``[N/16][K/8][16][4]``
bytes whose low nibble is column ``8o + j`` and high nibble column ``8o + 4 + j`` (K and the
group size multiples of 8); fp8 ``[N/16][K/2][16][2]`` (K even).
"""
from __future__ import annotations


import logging

import torch

from pagoda import cpu_features
from pagoda.kernels import select
from pagoda.kernels.build import Kernel

logger = logging.getLogger(__name__)


KIND_INT8, KIND_FP8, KIND_INT4, KIND_INT8G = 0, 1, 2, 3
MAX_INT8_K = 65536  # int32 sums of 255 * 127 per column stay exact below this
MAX_INT8G_GROUP = 256  # a group's sum of q * v (|q| <= 128, |v| <= 32639) stays within int32



_KERNEL = Kernel("woq", "CPU weight-only quantized matmul kernel", "using torch's ops")


def load() -> object | None:
    """The kernel library's op namespace, or None where the kernel cannot run (the scalar
    variant, no library, ``PAGODA_CPU_KERNELS=0``)."""
    ops = _KERNEL.load()
    if ops is None or not ops.woq_available():  # type: ignore[attr-defined]
        return None
    _apply_vnni(ops)
    return ops


_VNNI_LOGGED: set[bool] = set()


def _apply_vnni(ops: object) -> None:
    """Turns the avx2 variant's AVX-VNNI path on or off as ``select.avx_vnni()`` says (a no-op
    in the other variants), and logs once per state what the avx2 variant runs."""
    on = bool(ops.woq_set_vnni(select.avx_vnni()))  # type: ignore[attr-defined]
    if on in _VNNI_LOGGED:
        return
    _VNNI_LOGGED.add(on)
    if on:
        logger.info("weight-only int8/int4 kernels: AVX-VNNI (256-bit vpdpbusd)")
    elif select.isa().variant == "avx2":
        why = f"{select.VNNI_VAR}=0" if "avx_vnni" in cpu_features.cpu_flags() else "the CPU has no avx_vnni"
        logger.info("weight-only int8/int4 kernels: plain AVX2 (vpmaddwd; %s)", why)


def vnni_active() -> bool:
    """Whether the int8/int4 kernels run their 256-bit AVX-VNNI path in this process."""
    ops = load()
    return ops is not None and bool(ops.woq_vnni())  # type: ignore[attr-defined]


def supported(kind: int = KIND_INT8) -> bool:
    """Whether the kernel runs here for weights of ``kind``: int8 and int4 in the avx2 and avx512
    variants, fp8 in the avx512 one."""
    ops = load()
    return ops is not None and bool(ops.woq_has_kind(kind))  # type: ignore[attr-defined]


def usable(kind: int, n: int, k: int, device: torch.device, group_size: int = 0) -> bool:
    """Whether the kernel takes a ``[n, k]`` weight of ``kind`` (and the int4 / int8-in-groups
    ``group_size``) here."""
    if device.type != "cpu" or n % 16:
        return False
    if kind == KIND_INT8:
        shape_ok = k % 4 == 0 and k <= MAX_INT8_K
    elif kind == KIND_INT8G:
        shape_ok = 0 < group_size <= MAX_INT8G_GROUP and group_size % 4 == 0 and k % group_size == 0
    elif kind == KIND_INT4:
        shape_ok = k % 8 == 0 and group_size % 8 == 0 and k % group_size == 0
    else:
        shape_ok = k % 2 == 0
    return shape_ok and supported(kind)


def _int8_layout(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bytes in the int8 kinds' order, ``[N/16, K/4, 16, 4]``."""
    n, k = codes.shape
    return codes.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_int8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[N, K]`` as ``([N/16, K/4, 16, 4] int8, 128 * row sums [N] int32)``."""
    q = q.to(torch.int8)
    return _int8_layout(q), (q.to(torch.int32).sum(1) * 128).to(torch.int32).contiguous()


def pack_int8g(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """int8 ``[N, K]`` with ``[N, G]`` group scales (``W = scales[n, k // (K / G)] * q``) as
    ``(q + 128 as uint8 [N/16, K/4, 16, 4], float16 scales [N/16, G, 16])``: pack_int8's order,
    each 16-channel block's scales in one stream. Scales are rounded to float16 (exact where they
    are float16 numbers: GGUF Q8_0; else within 2**-11, or 2**-25 absolute below 6.1e-5); None
    where one is beyond float16's range (the caller keeps the layer off the kernel)."""
    n, g = q.shape[0], scales.shape[1]
    h = scales.to(torch.float32).to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        return None
    packed = _int8_layout((q.to(torch.int16) + 128).to(torch.uint8))
    return packed, h.reshape(n // 16, 16, g).transpose(1, 2).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 ``[N, K]`` as ``[N/16, K/8, 16, 4]`` uint8 nibble pairs."""
    n, k = q.shape
    q = q.to(torch.uint8)
    octets = q.reshape(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
    return (octets[..., 0, :] | (octets[..., 1, :] << 4)).contiguous()


def int4_group_terms(scale: torch.Tensor, term: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The int4 kernel's per-group metadata from ``[N, G]`` scales and zero terms (``w = scale *
    q + term``): float16 ``[G, N]`` each, rounded to nearest (within 2**-11 of each value,
    float16's unit roundoff, or 2**-25 absolute below 6.1e-5; exact where it is a float16
    number), or None where a value is beyond float16's range (the caller keeps the layer off
    the kernel). Where every rounded term is ``-8 *`` its rounded scale (symmetric codes: GGUF
    Q4_0, symmetric GPTQ) the terms are None: the kernel computes them, the same numbers, and
    reads 0.5625 bytes a weight instead of 0.625."""
    out = []
    for t in (scale, term):
        h = t.to(torch.float32).to(torch.float16)
        if not bool(torch.isfinite(h).all()):
            return None
        out.append(h.T.contiguous())
    if torch.equal(out[1].to(torch.float32), out[0].to(torch.float32) * -8.0):
        return out[0], None
    return out[0], out[1]


def pack_fp8(w: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 ``[N, K]`` as ``[N/16, K/2, 16, 2]`` bytes."""
    n, k = w.shape
    return w.view(torch.uint8).reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


_EMPTY = torch.empty(0)
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)


class WoqCPU:
    """The compiled kernel over one packed weight; ``__call__(x, bias)`` like the others."""

    kernel = "woq"

    def __init__(self, kind: int, packed: torch.Tensor, n: int, k: int, col_scale: torch.Tensor | None = None,
                 group_scale: torch.Tensor | None = None, group_bias: torch.Tensor | None = None,
                 group_size: int = 0, perm: torch.Tensor | None = None, aux: torch.Tensor | None = None) -> None:
        self.kind, self.packed, self.n, self.k, self.group_size, self.perm = kind, packed, n, k, group_size, perm
        f32 = lambda t: _EMPTY if t is None else t.to(torch.float32).contiguous()  # noqa: E731
        # int4's and grouped int8's group terms stay float16, as int4_group_terms and pack_int8g
        # make them (the kernel checks; no zero terms: symmetric codes)
        grouped = kind in (KIND_INT4, KIND_INT8G)
        meta = (lambda t: _EMPTY if t is None else t.contiguous()) if grouped else f32  # noqa: E731
        self.col_scale, self.group_scale, self.group_bias = f32(col_scale), meta(group_scale), meta(group_bias)
        self.aux = _EMPTY_I32 if aux is None else aux
        self.ops = load()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.col_scale, self.group_scale,
                                                           self.group_bias, self.aux))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (self.perm is None and bias is None and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == self.k
                and x.is_contiguous()):
            # The common float32 rows (a decode step's LM head): no reshapes or conversions,
            # each a cold call of some microseconds per step.
            out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
            self.ops.woq_linear(out, x, self.packed, self.kind, self.col_scale, self.group_scale,
                                self.group_bias, self.group_size, self.aux, None)
            return out
        if self.perm is not None:
            x = x[..., self.perm]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k).to(torch.float32).contiguous()
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        self.ops.woq_linear(out, x2, self.packed, self.kind, self.col_scale, self.group_scale,
                            self.group_bias, self.group_size, self.aux, b)
        return out.to(x.dtype).view(*lead, self.n)
