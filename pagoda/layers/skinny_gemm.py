"""Products of a few rows by a dense 16-bit or fp8 weight on the GPU: the library path or a
Triton kernel.

At decode a linear layer multiplies a few rows by a weight of megabytes: the time is the
weight's bytes, and cuBLAS's small-N kernels are bound by latency on small models' matrices
(docs/benchmarks.md). ``_skinny_kernel`` gives each program ``BLOCK_N`` output columns and a
``1 / SPLIT_K`` slice of K, the rows padded to ``BLOCK_M`` (16, or 32 for up to
``FP8_MAX_ROWS`` rows of an fp8 layer) for one tensor-core product a tile; with
``SPLIT_K > 1`` the programs write float32 partials that ``_reduce_kernel`` sums (bias and
rounding there). For one row ``_gemv_kernel`` skips the tensor cores (a 16-row tile would be 15
rows of padding): float32 products of a few columns by wide K steps, summed at the end.

``linear`` is what the unquantized layers call on CUDA; measured by default: on an H200 the
tiled kernel lost to cuBLAS on most projections, the one-row kernel won on every projection of
the Qwen3-0.6B shape (with the SiLU folded into the down projection), whose batch-1 decode step
went from 1.26 to 1.13 ms (docs/benchmarks.md, third lease). ``fp8_linear`` is what fp8 W8A8
layers call for a few rows: the kernel reads the e4m3 weight as stored (half the bytes) and applies its per-channel scales to the
float32 sums, against ``torch._scaled_mm`` with its activation quantizer; measured by default.

Measuring (``auto``): the first call of each (rows, N, K, dtype) class times the library path
and every ``configs`` entry on CUDA events, each run after the L2 cache was overwritten (a
decode step streams its weights from memory; timing a weight left in L2 chose a kernel that ran
3x slower in the step), and keeps the fastest; later calls run only the winner. Never measured
while a CUDA graph is being captured (the capture's warm-up call measures first).
``silu_mul_linear`` is the same choice for an MLP's down projection with its SiLU-and-mul folded
into the kernel's loads (the library path: the SiLU-and-mul kernel, then cuBLAS).
``norm_linear`` folds the (residual add +) RMSNorm before a projection into the one-row
kernel's loads (``_norm_gemv_kernel``: each program takes the whole row's rms, program 0 writes
the new residual stream to a buffer of its own), against the norm kernel then ``linear``'s
choice: at batch 1 the decoder's input norm rides in the qkv projection and the post-attention
add + norm in the gate_up projection, two launches a layer fewer.

``PAGODA_SKINNY_GEMM``: unset, each kind's default; ``cublas`` the library path always; ``auto``
measure for both kinds; ``triton`` forces the first config. On a host without CUDA the kernels
run only under Triton's interpreter (tests).
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from pagoda.env_vars import env_mode
from pagoda.kernels.triton_import import HAS_TRITON, tl, triton
from pagoda.layers import pdl

logger = logging.getLogger(__name__)

ENV = "PAGODA_SKINNY_GEMM"
MODES = ("default", "cublas", "auto", "triton")
DEFAULT_MODE = "auto"  # 16-bit weights: the one-row kernel beat cuBLAS on several (module notes)
FP8_DEFAULT_MODE = "auto"  # fp8 weights: measured against torch._scaled_mm, slow at a few rows
MAX_ROWS = 16  # 16-bit weights
FP8_MAX_ROWS = 32  # fp8 weights: W8A8's quantizer and _scaled_mm still slow at batch 32 (H200)


class Config(NamedTuple):
    """A kernel config: ``BLOCK_N`` output columns a program, ``BLOCK_K`` of K a loop step, K
    split over ``split_k`` programs, launch options; ``gemv``: the one-row kernel."""

    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int
    gemv: bool = False

    def label(self) -> str:
        return ("gemv-" if self.gemv else "") + "x".join(map(str, self[:5]))


# Narrow column tiles so that even a layer of 1024 outputs spreads over many SMs, split K where
# it still leaves too few programs.
CONFIGS = tuple(Config(*c) for c in ((16, 256, 1, 4, 4), (32, 256, 1, 4, 4), (16, 256, 2, 4, 4), (16, 128, 4, 4, 4),
                                     (64, 128, 1, 4, 4)))
# With SiLU-and-mul in the loads a K tile holds gate and up: tiles of 128 keep it in registers.
SILU_CONFIGS = tuple(Config(*c) for c in ((16, 128, 1, 4, 4), (16, 128, 2, 4, 4), (16, 128, 4, 4, 4)))
# One row (batch-1 decode): no tensor-core tile to pad; wide K steps of a few columns, so each
# thread keeps several 16-byte loads of the weight in flight.
GEMV_CONFIGS = tuple(Config(*c, gemv=True) for c in ((4, 1024, 1, 8, 3), (8, 512, 1, 8, 3), (8, 1024, 1, 8, 3),
                                                      (2, 2048, 1, 8, 2), (4, 512, 2, 4, 3), (16, 256, 1, 4, 4)))
# More than 16 rows (fp8 weights at batch 17-32): every program reads all the rows' K slice, so
# narrow column tiles read the activations many times over; wide tiles with split K instead.
# (128-wide tiles of 128 K spill on sm_90.)
WIDE_CONFIGS = tuple(Config(*c) for c in ((64, 128, 4, 8, 3), (64, 128, 2, 8, 3), (128, 64, 4, 8, 3),
                                          (64, 64, 4, 8, 4)))
SILU_GEMV_CONFIGS = tuple(Config(*c, gemv=True) for c in ((4, 512, 1, 4, 3), (8, 512, 1, 8, 3), (4, 512, 2, 4, 3)))
# The one-row kernel with an RMSNorm (and residual add) folded into its loads: the same K steps.
NORM_CONFIGS = GEMV_CONFIGS

if HAS_TRITON:
    from pagoda.layers.pdl import pdl_enter

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                       stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SILU_MUL: tl.constexpr,
                       W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_mask = rows[:, None] < M
        col_mask = cols[:, None] < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks[None, :] < k_end
            x_at = x_ptr + rows[:, None] * stride_xm + ks[None, :]
            x = tl.load(x_at, mask=row_mask & k_mask, other=0.0)
            if SILU_MUL:  # x holds [gate | up]: the product's input is silu(gate) * up, rounded as stored
                gate = x.to(tl.float32)
                up = tl.load(x_at + K, mask=row_mask & k_mask, other=0.0).to(tl.float32)
                x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=col_mask & k_mask,
                        other=0.0)
            if W_SCALE:  # an fp8 weight: exact in the activations' 16-bit type, its scale applied after
                w = w.to(x_ptr.dtype.element_ty)
            if UPCAST:  # the interpreter multiplies 16-bit operands as raw integers
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        out_mask = row_mask & (cols[None, :] < N)
        if W_SCALE:  # per output channel: every split's partial scaled alike
            acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if SPLIT_K == 1:
            if BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(part_ptr + (pid_k * M + rows[:, None]) * N + cols[None, :], acc, mask=out_mask)

    @triton.jit
    def _row_times_weight(acc, x, w_ptr, cols, col_mask, ks, k_mask, stride_wn):
        """``acc`` plus the products of one K step of the row ``x`` by ``BLOCK_N`` weight rows."""
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]

    @triton.jit
    def _store_row(y, cols, col_mask, bias_ptr, y_ptr, part_ptr, pid_k, N, SPLIT_K: tl.constexpr,
                   BIAS: tl.constexpr):
        """A one-row program's sums: rounded into ``y`` (with the bias), or its split's float32
        partials for ``_reduce_kernel``."""
        if SPLIT_K == 1:
            if BIAS:
                y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)
        else:
            tl.store(part_ptr + pid_k * N + cols, y, mask=col_mask)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, N, K, k_per_split, stride_wn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < k_end
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
            if SILU_MUL:  # x holds [gate | up]: the product's input is silu(gate) * up, rounded as stored
                gate = x.to(tl.float32)
                up = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0).to(tl.float32)
                x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
            acc = _row_times_weight(acc, x, w_ptr, cols, col_mask, ks, k_mask, stride_wn)
        y = tl.sum(acc, axis=1)
        if W_SCALE:  # per output channel: every split's partial scaled alike
            y *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
        _store_row(y, cols, col_mask, bias_ptr, y_ptr, part_ptr, pid_k, N, SPLIT_K, BIAS)

    @triton.jit
    def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, new_res_ptr, N, K, k_per_split,
                          stride_wn, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                          BIAS: tl.constexpr, RESIDUAL: tl.constexpr, ROW_BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
        pdl_enter(PDL)
        # ``_gemv_kernel`` of rms_norm(x (+ residual)) * nw, the norm rounded as fused_ops'
        # ``_rms_norm_kernel`` rounds it: the sum to the model dtype, the normed row likewise.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        # Every program takes the whole row's rms as the norm kernel does (one block of the row).
        row = tl.arange(0, ROW_BLOCK)
        row_mask = row < K
        h = tl.load(x_ptr + row, mask=row_mask, other=0.0)
        if RESIDUAL:
            r = tl.load(res_ptr + row, mask=row_mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
            if pid_n + pid_k == 0:  # one program writes the new residual stream, into its own
                tl.store(new_res_ptr + row, h, mask=row_mask)  # buffer: the others still read ``residual``
        h = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < k_end
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
            if RESIDUAL:  # (names apart from the row's above: a loop may not change their shapes)
                r_k = tl.load(res_ptr + ks, mask=k_mask, other=0.0)
                x = (x.to(tl.float32) + r_k.to(tl.float32)).to(x_ptr.dtype.element_ty)
            nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd * nw).to(x_ptr.dtype.element_ty)
            acc = _row_times_weight(acc, x, w_ptr, cols, col_mask, ks, k_mask, stride_wn)
        _store_row(tl.sum(acc, axis=1), cols, col_mask, bias_ptr, y_ptr, part_ptr, pid_k, N, SPLIT_K, BIAS)

    @triton.jit
    def _reduce_kernel(part_ptr, bias_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       BIAS: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
        if BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: Config | None = None, silu_mul: bool = False,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` (``M <= MAX_ROWS``; ``FP8_MAX_ROWS`` for an fp8
    weight) and ``weight`` ``[N, K]`` (unit inner
    strides) on ``_skinny_kernel`` with ``config`` (see ``CONFIGS``; a ``gemv`` config, one row,
    on ``_gemv_kernel``). ``silu_mul``: ``x`` is
    ``[M, 2K]`` (gate | up) and the product's input is ``silu(gate) * up`` (``SILU_CONFIGS``).
    ``scales`` (float32 ``[N]``): ``weight`` is float8 e4m3 and the product is
    ``x @ (scales[:, None] * weight).T`` (fp8 weights read as they are stored). ``config`` None:
    the first of its list."""
    config = config or configs(silu_mul, x.shape[0])[0]
    block_n, block_k, split_k, warps, stages = config[:5]
    m, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    max_rows = FP8_MAX_ROWS if scales is not None else MAX_ROWS
    if m > max_rows or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"skinny_matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} (at most {max_rows} rows)")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # Each split's K range a whole number of tiles, so no tile straddles two splits.
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    bias_arg = bias if bias is not None else y
    if getattr(config, "gemv", False):
        if m != 1:
            raise ValueError(f"skinny_matmul: the one-row kernel got {m} rows")
        _gemv_kernel[(triton.cdiv(n, block_n), split_k)](
            x, weight, scales if scales is not None else y, bias_arg, y, part, n, k, k_per_split, weight.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BIAS=bias is not None and split_k == 1,
            SILU_MUL=silu_mul, W_SCALE=scales is not None, num_warps=warps, num_stages=stages,
            **pdl.launch_options(x.device))
    else:
        _skinny_kernel[(triton.cdiv(n, block_n), split_k)](
            x, weight, scales if scales is not None else y, bias_arg, y, part, m, n, k, k_per_split, x.stride(0),
            weight.stride(0), y.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            BIAS=bias is not None and split_k == 1, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            UPCAST=bool(triton.knobs.runtime.interpret), SILU_MUL=silu_mul, W_SCALE=scales is not None,
            BLOCK_M=16 if m <= 16 else 32, num_warps=warps, num_stages=stages, **pdl.launch_options(x.device))
    if split_k > 1:
        _reduce(part, bias, y)
    return y


def _reduce(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """``y`` = the sum of the float32 partials ``part`` ``[split_k, M, N]`` (+ ``bias``), rounded."""
    split_k, m, n = part.shape
    block = 1024
    _reduce_kernel[(m, triton.cdiv(n, block))](part, bias if bias is not None else y, y, m, n, y.stride(0),
                                               SPLIT_K=split_k, BLOCK=block, BIAS=bias is not None, num_warps=4,
                                               **pdl.launch_options(y.device))


# ``norm_matmul``'s row width at most: every program holds the whole row for its rms.
NORM_MAX_K = 8192


def norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h) * norm_weight) @ weight.T + bias`` and ``h``, for one row ``x`` ``[1, K]``
    (``K <= NORM_MAX_K``) and ``h = x + residual`` (``x`` without one), on ``_norm_gemv_kernel``
    with the ``gemv`` ``config`` (``NORM_CONFIGS``; None: the first). Rounded as
    ``fused_ops.fused_add_rms_norm`` (``rms_norm``) then the product rounds: ``h`` and the normed
    row to ``x``'s dtype. ``h`` is a new tensor (``x`` itself without a residual)."""
    config = config or NORM_CONFIGS[0]
    block_n, block_k, split_k, warps, stages = config[:5]
    n, k = weight.shape
    if not config.gemv or x.shape != (1, k) or k > NORM_MAX_K or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm_matmul: one row of at most {NORM_MAX_K} and a one-row config, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, {config.label()}")
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(x) if residual is not None else x
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    part = torch.empty(split_k, 1, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    _norm_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, residual.contiguous() if residual is not None else x, norm_weight, weight,
        bias if bias is not None else y, y, part, new_res, n, k, k_per_split, weight.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BIAS=bias is not None and split_k == 1,
        RESIDUAL=residual is not None, ROW_BLOCK=triton.next_power_of_2(k), num_warps=warps, num_stages=stages,
        **pdl.launch_options(x.device))
    if split_k > 1:
        _reduce(part, bias, y)
    return y, new_res


Kernel = Callable[[], torch.Tensor]
Timed = Callable[[], object]  # a candidate's run, timed: its result is not looked at


_L2_FLUSH: dict[int, torch.Tensor] = {}


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """Twice the L2 cache of ``device``, written before each timed run (one per device; made as
    an inference tensor, as the engine's first call may be in inference mode, and written in it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _L2_FLUSH:
        size = max(torch.cuda.get_device_properties(index).L2_cache_size, 1 << 20)
        with torch.inference_mode():
            _L2_FLUSH[index] = torch.empty(2 * size, dtype=torch.uint8, device=device)
    return _L2_FLUSH[index]


# A spin of about 150 us on the device before each timed run, longer than the host takes to
# launch a candidate's kernels: the run is then timed back to back, as a CUDA graph replays it,
# not stretched by Python's launch time (which made two-launch W8A8 and Triton kernels look slow).
LAUNCH_COVER_CYCLES = 300_000


def cold_ms(fn: Timed, reps: int = 10) -> float:
    """Mean milliseconds of ``fn`` from a cold L2: the cache overwritten before each run, the
    device kept busy while the host launches the run (``LAUNCH_COVER_CYCLES``), and only the run
    between the events."""
    flush = _l2_flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        with torch.inference_mode():
            flush.zero_()
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)
        start.record()
        fn()
        end.record()
    pairs[-1][1].synchronize()
    return sum(start.elapsed_time(end) for start, end in pairs) / reps


class SkinnyChoice:
    """The winner per (rows, N, K, dtype, kind) class between the library path and the kernel
    configs (module notes; kind: plain, SiLU-and-mul folded, norm folded with or without the
    residual add). ``timer(fn) -> ms`` times a candidate (cold-L2 CUDA events by default; the
    tests pass their own); ``capturing()`` says whether a CUDA graph is being captured (no
    measuring then). ``ENV`` is read on the first product and kept: every linear layer of every
    eager step asks."""

    def __init__(self, timer: Callable[[Timed], float] = cold_ms,
                 capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing) -> None:
        self.timer = timer
        self.capturing = capturing
        # index into ``configs(silu_mul, rows)`` (``NORM_CONFIGS`` for a norm class); -1: the library path
        self.winners: dict[tuple, int] = {}
        self.mode: str | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False,
               scales: torch.Tensor | None = None, library: Kernel | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` (``silu_mul``: of ``silu(gate) * up`` for ``x`` = gate | up).
        ``scales``: ``weight`` is fp8 with these per-channel scales, and ``library`` computes the
        same product the library's way (``torch._scaled_mm``); otherwise the library is cuBLAS."""
        fp8 = scales is not None
        if library is None:
            def library() -> torch.Tensor:
                return _peer(x, weight, bias, silu_mul)
        mode = self.mode_for(fp8)
        if mode == "cublas":
            return library()
        if mode == "triton":
            return skinny_matmul(x, weight, bias, silu_mul=silu_mul, scales=scales)
        key = (x.shape[0], weight.shape[0], weight.shape[1], weight.dtype, silu_mul)
        tried = configs(silu_mul, x.shape[0])
        winner = self._winner(key, library, tried,
                              lambda config: skinny_matmul(x, weight, bias, config, silu_mul, scales))
        if winner < 0:
            return library()
        return skinny_matmul(x, weight, bias, tried[winner], silu_mul, scales)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm_matmul``'s result for one row, or the same by the library path: the norm kernel
        (``fused_add_rms_norm``, or ``rms_norm`` without a residual), then ``linear``'s choice.
        Its own class per (N, K, dtype, with or without a residual)."""
        from pagoda.layers import fused_ops

        def library() -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                return self.linear(fused_ops.rms_norm(x, norm_weight, eps), weight, bias), x
            h, new_residual = fused_ops.fused_add_rms_norm(x, residual, norm_weight, eps)
            return self.linear(h, weight, bias), new_residual

        mode = self.mode_for(False)
        if mode == "cublas":
            return library()
        if mode == "triton":
            return norm_matmul(x, residual, norm_weight, eps, weight, bias)
        key = (1, weight.shape[0], weight.shape[1], weight.dtype, "add_norm" if residual is not None else "norm")
        winner = self._winner(key, library, NORM_CONFIGS,
                              lambda config: norm_matmul(x, residual, norm_weight, eps, weight, bias, config))
        if winner < 0:
            return library()
        return norm_matmul(x, residual, norm_weight, eps, weight, bias, NORM_CONFIGS[winner])

    def current_mode(self) -> str:
        """``ENV`` as read on the first call (``default`` when unset)."""
        if self.mode is None:
            self.mode = env_mode(ENV, MODES, "default")
        return self.mode

    def mode_for(self, fp8: bool) -> str:
        """The mode for a 16-bit (``fp8`` False) or an fp8 weight: ``ENV``, else that kind's default."""
        mode = self.current_mode()
        return (FP8_DEFAULT_MODE if fp8 else DEFAULT_MODE) if mode == "default" else mode

    def _winner(self, key: tuple, library: Timed, tried: tuple[Config, ...], run: Callable[[Config], object]) -> int:
        """The class's winner: an index into ``tried`` (whose configs ``run`` runs), -1 for
        ``library``; measured on the class's first call, the library's while capturing."""
        winner = self.winners.get(key)
        if winner is None:
            if self.capturing():
                return -1  # measured on a later eager call
            winner = self._measure(key, library, tried, run)
        return winner

    def _measure(self, key: tuple, library: Timed, tried: tuple[Config, ...], run: Callable[[Config], object]) -> int:
        library()  # warm-up: the library's first call of a shape sets itself up
        times = {-1: self.timer(library)}
        for i, config in enumerate(tried):
            try:
                run(config)  # compiles outside the timing
                times[i] = self.timer(lambda config=config: run(config))
            except Exception as exc:  # noqa: BLE001 - a config the card cannot build loses
                logger.info("skinny GEMM %s: config %s unavailable (%s)", key, config, exc)
        winner = min(times, key=times.get)
        self.winners[key] = winner
        logger.info("skinny GEMM %s: library %.1f us, best kernel %s: %s", key, times[-1] * 1e3,
                    min((t * 1e3, tried[i]) for i, t in times.items() if i >= 0) if len(times) > 1
                    else None, "library" if winner < 0 else tried[winner])
        return winner


def configs(silu_mul: bool, rows: int = 1) -> tuple[Config, ...]:
    """The kernel configs a choice tries: ``SILU_CONFIGS`` with the activation folded in; for
    more than 16 rows (32-row tiles) none of four warps wider than 32 columns (64 x 128 spills
    on sm_90), then ``WIDE_CONFIGS``; for one row the one-row kernel's configs after the tiled
    kernel's."""
    if silu_mul:
        return SILU_CONFIGS + (SILU_GEMV_CONFIGS if rows == 1 else ())
    if rows == 1:
        return CONFIGS + GEMV_CONFIGS
    return CONFIGS if rows <= 16 else tuple(c for c in CONFIGS if c[0] <= 32) + WIDE_CONFIGS


def _peer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """What the kernel competes with: cuBLAS, after the SiLU-and-mul launch for ``silu_mul``."""
    if silu_mul:
        from pagoda.layers.fused_ops import silu_and_mul

        x = silu_and_mul(x)
    return F.linear(x, weight, bias)


CHOICE = SkinnyChoice()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` may take the Triton kernel: CUDA, 2-D ``x`` of at most ``MAX_ROWS``
    rows, a 16-bit weight with a unit inner stride, and ``ENV`` not cuBLAS."""
    return (HAS_TRITON and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype
            and weight.stride(1) == 1 and CHOICE.mode_for(False) != "cublas")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a few rows on the GPU, through the chosen kernel (module notes)."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    return CHOICE.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` = gate | up ``[M, 2K]`` times ``weight.T`` ``[K, N]``: an MLP's
    activation and down projection, in one launch where that measured faster than the SiLU-and-mul
    kernel then cuBLAS (the caller checks ``applies``)."""
    return CHOICE.linear(x, weight, None, silu_mul=True)


def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``norm_linear`` may take the kernel: ``applies``, one row, ``K <= NORM_MAX_K``."""
    # The row count first (a batch's layers ask twice each); ``applies`` before the weight's
    # shape (a CPU layer's packed weight is not 2-D).
    return (x.dim() == 2 and x.shape[0] == 1 and applies(x, weight) and weight.dim() == 2
            and weight.shape[1] <= NORM_MAX_K)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(h_normed, weight, bias), h)`` where ``h_normed, h = fused_add_rms_norm(x,
    residual, norm_weight, eps)`` (without a residual: ``rms_norm(x, ...)`` and ``h = x``) for
    one row: the norm in the one-row kernel's loads, or the norm kernel then ``linear``, whichever
    measured faster for the shape (the caller checks ``norm_applies``)."""
    return CHOICE.norm_linear(x, residual, norm_weight, eps, weight, bias)


def fp8_applies(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether an fp8 layer may take the kernel for ``x``: CUDA, 2-D ``x`` of at most
    ``FP8_MAX_ROWS`` 16-bit rows, an e4m3 weight with a unit inner stride, ``ENV`` not cuBLAS."""
    return (HAS_TRITON and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= FP8_MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and wq.dtype == torch.float8_e4m3fn
            and wq.stride(1) == 1 and CHOICE.mode_for(True) != "cublas")


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, library: Kernel) -> torch.Tensor:
    """``x @ (scales[:, None] * wq).T`` for a few rows (the caller checks ``fp8_applies``): the
    kernel reading the fp8 weight as stored, or ``library`` (W8A8 ``_scaled_mm``), whichever
    measured faster for the shape (module notes)."""
    return CHOICE.linear(x, wq, None, scales=scales, library=library)
