"""fp8 W8A8: float8 e4m3 weights times float8 e4m3 activations through ``torch._scaled_mm``.

``y = (sa[m] * xq[m, :]) @ (sw[n] * wq[n, :]).T``: the weight ``wq`` ``[N, K]`` with one float32
scale per output channel ``sw`` (a per-tensor scale is the same scale repeated), the activations
quantized per token on every call (dynamic: ``sa[m] = max|x[m, :]| / 448``, ``xq = x / sa``
rounded to e4m3). The fp8 products accumulate in float32 inside the matmul, which applies both
scales to its output (row-wise scaling), in bfloat16 on CUDA (the only output type that scaling
takes there), in the activation dtype elsewhere.

Layouts ``_scaled_mm`` requires: the first operand row-major, the second column-major (``wq``
stored ``[N, K]`` row-major and passed as ``wq.t()``), K and N multiples of 16; scales
``[M, 1]`` and ``[1, N]`` float32. At 16, 32, 48 or 64 rows the operands swap (``wq`` first, the
rows' ``xq.t()`` second, the output transposed back): the library then tiles the weight's long
side (``swaps_operands``).

When it is chosen (``matmul_mode``), with one log line per reason:

- ``PAGODA_FP8_MATMUL=auto`` (the default): on CUDA cards of compute capability 8.9 or more
  (Ada, Hopper, Blackwell: the ones with fp8 tensor cores); elsewhere the weights stay fp8 (or
  are dequantized once on CPU) and multiply weight-only in the model dtype.
- ``w8a8``: also on CPU, where ``torch._scaled_mm`` runs slowly (for tests and the dry run of
  ``pagoda bench gpu all``); refused (``ValueError``) on a CUDA card without fp8.
  ``weight-only``: never.
- A layer whose K or N is not a multiple of 16 runs weight-only (logged once).

At decode's few rows (at most ``skinny_gemm.FP8_MAX_ROWS``) on CUDA, ``_scaled_mm`` competes per
shape with ``skinny_gemm``'s kernel reading the fp8 weight as stored and multiplying it with the
unquantized 16-bit activations (W8A16: half a bf16 weight's bytes, no activation quantizer
launch), the faster kept (``PAGODA_SKINNY_GEMM``; an H200 ran the 8B shape's W8A8 decode below
bf16's speed, docs/benchmarks.md).

Block-scaled checkpoints (DeepSeek-V3's ``weight_block_size``: scales vary along K, which
row-wise scaling cannot express) take ``Fp8BlockScaledMM`` under the same choice: activations
quantized per token and per K group of the block's width, and the Triton block-scaled fp8 GEMM
(``triton_fp8.block_fp8_matmul``) applies each group's two scales to its partial product. On a
CPU (forced) the same arithmetic runs in torch (``block_matmul_torch``). A block width that is
not a power of two of at least 16 runs weight-only.
"""
from __future__ import annotations

import logging

import torch

from pagoda.env_vars import env_mode
from pagoda.layers import fused_ops, skinny_gemm
from pagoda.layers.quantization import triton_fp8
from pagoda.layers.quantization.kernels import QuantLinear

logger = logging.getLogger(__name__)

FP8_MAX = triton_fp8.FP8_MAX
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (sm_89), Hopper (sm_90) and later
MODES = ("auto", "w8a8", "weight-only")
ENV = "PAGODA_FP8_MATMUL"
_logged: set[str] = set()


def _log_once(message: str, *args: object) -> None:
    text = message % args
    if text not in _logged:
        _logged.add(text)
        logger.info(text)


def requested_mode() -> str:
    return env_mode(ENV, MODES)


def card_refusal(device: torch.device) -> str | None:
    """Why ``device`` has no fp8 matmul worth using (None when it has one)."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch build has no torch._scaled_mm"
    if device.type != "cuda":
        return f"{device.type} has no fp8 matmul units"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return "the card (sm_{}{}) has no fp8 tensor cores (sm_89 or later)".format(*capability)
    return None


def matmul_mode(device: torch.device, n: int, k: int) -> str:
    """``w8a8`` or ``weight-only`` for an ``[n, k]`` fp8 weight on ``device`` (see the module
    docstring); logs the reason for the choice once per process and reason."""
    mode = requested_mode()
    if mode == "weight-only":
        _log_once("fp8: weight-only matmuls in the model dtype (%s=weight-only)", ENV)
        return mode
    if n % 16 or k % 16:
        _log_once("fp8: a [%d, %d] weight runs weight-only: torch._scaled_mm needs both dims multiples of 16", n, k)
        return "weight-only"
    refusal = card_refusal(device)
    if refusal is not None and mode == "auto":
        _log_once("fp8: weight-only matmuls in the model dtype: %s", refusal)
        return "weight-only"
    if refusal is not None and (device.type != "cpu" or not hasattr(torch, "_scaled_mm")):
        raise ValueError(f"{ENV}=w8a8 cannot be honoured: {refusal}")
    _log_once("fp8: W8A8 matmuls (torch._scaled_mm, per-token dynamic activation scales) on %s%s", device.type,
              " (forced; no fp8 units: slow)" if refusal is not None else "")
    return "w8a8"


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3 (weights per output channel, activations per token): ``x`` ``[M, K]``
    -> ``(xq float8_e4m3fn [M, K], scales [M] float32)``, ``scales = max(amax, 1e-12) / 448``
    with ``amax = max|x[m]|`` unless given (tensor parallelism shares one), ``xq = x / scales``
    rounded to nearest."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1) if amax is None else amax
    scales = amax.clamp(min=triton_fp8.MIN_AMAX) / FP8_MAX
    return (xf / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference activation quantizer: ``quantize_rows`` with the scales as ``[M, 1]``."""
    xq, scales = quantize_rows(x)
    return xq, scales[:, None]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``quantize_per_token_torch``; one Triton kernel on CUDA."""
    if x.is_cuda and triton_fp8.HAS_TRITON:
        return triton_fp8.per_token_fp8(x)
    return quantize_per_token_torch(x)


def quantize_per_token_group_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference group quantizer: ``x`` ``[M, K]`` -> ``(xq float8_e4m3fn [M, K], scales
    [M, ceil(K / group)] float32)``, each row's groups of ``group`` columns as ``quantize_rows``."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - k)).view(m * groups, group)
    q, scales = quantize_rows(padded)
    return q.view(m, groups * group)[:, :k], scales.view(m, groups)


def block_matmul_torch(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, group: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """``triton_fp8.block_fp8_matmul``'s arithmetic in torch: both operands scaled group by group
    in float32, then multiplied."""
    k = xq.shape[1]
    a = xq.to(torch.float32) * xs.repeat_interleave(group, dim=1)[:, :k]
    w = wq.to(torch.float32) * ws.repeat_interleave(group, dim=1)[:, :k]
    return (a @ w.t()).to(out_dtype)


class Fp8BlockScaledMM(QuantLinear):
    """``x @ w.T + bias`` for a block-scaled e4m3 weight (``scales`` ``[N, ceil(K / group)]``, one
    row per output feature) with ``x`` quantized per token and per group of ``group`` columns."""

    kernel = "fp8_block_scaled_mm"

    def __init__(self, wq: torch.Tensor, scales: torch.Tensor, group: int) -> None:
        if wq.dtype != torch.float8_e4m3fn:
            raise ValueError(f"W8A8 takes float8_e4m3fn weights, got {wq.dtype}")
        self.wq = wq.contiguous()
        self.scales = scales.to(device=wq.device, dtype=torch.float32).contiguous()
        self.group = group

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if fused_ops.use_triton(x2):
            xq, xs = triton_fp8.per_token_group_fp8(x2, self.group)
            y = triton_fp8.block_fp8_matmul(xq, xs, self.wq, self.scales, self.group, x.dtype)
        else:
            xq, xs = quantize_per_token_group_torch(x2, self.group)
            y = block_matmul_torch(xq, xs, self.wq, self.scales, self.group, x.dtype)
        y = y.view(*lead, self.wq.shape[0])
        return y + bias if bias is not None else y


def block_w8a8_linear(wq: torch.Tensor, scales: torch.Tensor, group: int) -> QuantLinear | None:
    """``Fp8BlockScaledMM`` for an e4m3 weight ``[N, K]`` with per-row, per-K-group ``scales``
    where ``matmul_mode`` picks W8A8 for it and the group width suits the kernel, else None."""
    if wq.dtype != torch.float8_e4m3fn:
        return None
    if group < 16 or group & (group - 1) or not triton_fp8.HAS_TRITON:
        _log_once("fp8: blocks %d wide run weight-only (the block-scaled kernel needs Triton and a width that is "
                  "a power of two from 16)", group)
        return None
    n, k = wq.shape
    if matmul_mode(wq.device, n, k) != "w8a8":
        return None
    return Fp8BlockScaledMM(wq, scales, group)


class Fp8ScaledMM(QuantLinear):
    """``x @ (scales[:, None] * wq).T + bias`` with ``x`` quantized per token (W8A8)."""

    kernel = "fp8_scaled_mm"

    def __init__(self, wq: torch.Tensor, scales: torch.Tensor) -> None:
        if wq.dtype != torch.float8_e4m3fn:
            raise ValueError(f"W8A8 takes float8_e4m3fn weights, got {wq.dtype}")
        n = wq.shape[0]
        self.wq = wq.contiguous()  # [N, K] row-major: .t() is the column-major operand
        s = scales.to(device=wq.device, dtype=torch.float32).reshape(-1)
        self.scale_b = (s.expand(n) if s.numel() == 1 else s).reshape(1, n).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if skinny_gemm.fp8_applies(rows, self.wq):  # a few rows: maybe the kernel that reads fp8 weights as stored
            y = skinny_gemm.fp8_linear(rows, self.wq, self.scale_b.view(-1), lambda: self.scaled_mm(rows))
        else:
            y = self.scaled_mm(rows)
        y = y.view(*lead, self.wq.shape[0])
        return y + bias if bias is not None else y

    def scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 of ``x`` ``[M, K]``: its rows quantized per token, then ``torch._scaled_mm``; for a
        few rows (``swaps_operands``) as ``(wq @ xq.T).T``."""
        xq, scale_a = quantize_per_token(x)
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        if swaps_operands(x.shape[0]):
            y = torch._scaled_mm(self.wq, xq.t(), scale_a=self.scale_b.view(-1, 1), scale_b=scale_a.view(1, -1),
                                 out_dtype=out_dtype).t().contiguous()
        else:
            y = torch._scaled_mm(xq, self.wq.t(), scale_a=scale_a, scale_b=self.scale_b, out_dtype=out_dtype)
        return y.to(x.dtype)


SWAP_MAX_ROWS = 64


def swaps_operands(rows: int) -> bool:
    """Whether W8A8 of ``rows`` rows multiplies with the weight as the first operand: the
    library's tiles for a few rows (128 x 128 on an H200) leave most of each tile and most SMs
    idle, while the weight's side is long; the second operand's columns (the rows) must then be a
    multiple of 16."""
    return 0 < rows <= SWAP_MAX_ROWS and rows % 16 == 0


def w8a8_linear(wq: torch.Tensor, row_scales: torch.Tensor) -> QuantLinear | None:
    """``Fp8ScaledMM`` for an e4m3 weight ``[N, K]`` with per-channel (``[N]``) or per-tensor
    (one value) scales where ``matmul_mode`` picks W8A8 for it, else None (weight-only)."""
    if wq.dtype != torch.float8_e4m3fn:
        return None
    n, k = wq.shape
    if matmul_mode(wq.device, n, k) != "w8a8":
        return None
    return Fp8ScaledMM(wq, row_scales)
