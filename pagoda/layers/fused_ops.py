"""Fused elementwise/normalisation ops: Triton kernels for CUDA, torch versions for CPU.

Every op exists three times:
  * ``torch_<op>``: the reference, used on CPU. It computes in fp32 and rounds once, exactly
    like the kernel, so the two paths agree to rounding.
  * ``triton_<op>``: one Triton launch; memory-bound, so fusing saves whole HBM round trips.
  * ``<op>``: the dispatch the model code calls. It picks Triton when the tensor is on CUDA,
    or when ``PAGODA_FORCE_TRITON=1`` (tests run the kernels on CPU under Triton's interpreter);
    for float32 CPU tensors the compiled C++ versions in ``cpu_fused`` (one call per op instead
    of 5-15 small torch ops, which dominate a batch-1 decode step's non-matmul time), else the
    torch reference.

Triton is optional: without it everything falls back to the torch versions. On a host without
CUDA the kernels can only run under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before ``triton`` is first imported.
"""
from __future__ import annotations

import os
import torch
import torch.nn.functional as F

from pagoda.kernels import fused as cpu_fused
from pagoda.kernels.triton_import import HAS_TRITON, tl, triton
from pagoda.layers import pdl


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused ops should take the Triton path for tensor ``x``."""
    if not HAS_TRITON:
        return False
    return x.is_cuda or os.environ.get("PAGODA_FORCE_TRITON") == "1"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as [rows, last_dim] with a unit inner stride (copying only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    # One program per row: wider rows need more warps to keep enough loads in flight.
    return max(1, min(16, block // 256))


# --------------------------------------------------------------------------------------
# torch references (the CPU path)
# --------------------------------------------------------------------------------------


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def torch_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return torch_rms_norm(new_residual, weight, eps), new_residual


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((out, x[..., rot:]), dim=-1) if rot < x.shape[-1] else out


def torch_apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding; ``cos_sin_cache[p]`` is ``[cos(rot/2) | sin(rot/2)]``.

    The rotary width is the cache's last dim; head dims beyond it pass through unchanged.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return _torch_rotate(q, cos, sin), _torch_rotate(k, cos, sin)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if HAS_TRITON:
    from pagoda.layers.pdl import pdl_enter

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, new_res_ptr,
                         stride_x, stride_r, stride_y, stride_nr, n_cols, eps,
                         ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if ADD_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            # Round the sum to the activation dtype before normalising it, so y is exactly the
            # norm of the residual stream that the next layer will see.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
            tl.store(new_res_ptr + row * stride_nr + cols, x, mask=mask)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, n_cols, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, gate * tl.sigmoid(gate) * up, mask=mask)

    @triton.jit
    def _rotate_heads(src_ptr, dst_ptr, stride_st, stride_sh, stride_dt, stride_dh, t,
                      n_heads, cos, sin,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      H_PAD: tl.constexpr, PASS_PAD: tl.constexpr):
        heads = tl.arange(0, H_PAD)
        offs = tl.arange(0, HALF_PAD)
        mask = (heads[:, None] < n_heads) & (offs[None, :] < HALF)
        src = src_ptr + t * stride_st + heads[:, None] * stride_sh + offs[None, :]
        dst = dst_ptr + t * stride_dt + heads[:, None] * stride_dh + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
        tl.store(dst + HALF, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)
        if PASS_PAD > 0:  # partial rotary: copy the untouched tail of each head
            tail = 2 * HALF + tl.arange(0, PASS_PAD)
            tmask = (heads[:, None] < n_heads) & (tail[None, :] < HEAD_DIM)
            x = tl.load(src_ptr + t * stride_st + heads[:, None] * stride_sh + tail[None, :],
                        mask=tmask)
            tl.store(dst_ptr + t * stride_dt + heads[:, None] * stride_dh + tail[None, :], x,
                     mask=tmask)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
                       n_q_heads, n_k_heads,
                       HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
                       PDL: tl.constexpr = False):
        pdl_enter(PDL)
        # One program per token: cos/sin are loaded once and shared by all q and k heads.
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs = tl.arange(0, HALF_PAD)
        cmask = offs < HALF
        cos = tl.load(cache_ptr + pos * stride_cache + offs, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs, mask=cmask,
                      other=0.0).to(tl.float32)
        _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t,
                      n_q_heads, cos, sin, HALF, HALF_PAD, HEAD_DIM, QH_PAD, PASS_PAD)
        _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t,
                      n_k_heads, cos, sin, HALF, HALF_PAD, HEAD_DIM, KH_PAD, PASS_PAD)


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(y) if residual is not None else y
    n_rows, n_cols = x2.shape
    block = triton.next_power_of_2(n_cols)
    if n_rows > 0:
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, y, new_res, x2.stride(0), r2.stride(0), y.stride(0),
            new_res.stride(0), n_cols, eps, ADD_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=_row_warps(block), **pdl.launch_options(x.device))
    y = y.view(x.shape)
    return y, (new_res.view(x.shape) if residual is not None else None)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_norm(x, None, weight, eps)[0]


def triton_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, new_residual = _launch_norm(x, residual, weight, eps)
    return y, new_residual


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    n_rows, width = x2.shape
    inter = width // 2
    y = torch.empty((n_rows, inter), dtype=x.dtype, device=x.device)
    # Columns are split over programs too, so a few decode rows still spread over many SMs.
    block = min(triton.next_power_of_2(max(inter, 1)), 1024)
    if n_rows > 0 and inter > 0:
        _silu_and_mul_kernel[(n_rows, triton.cdiv(inter, block))](
            x2, y, x2.stride(0), y.stride(0), inter, BLOCK=block, num_warps=4, **pdl.launch_options(x.device))
    return y.view(*x.shape[:-1], inter)


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, cache = _unit_inner(q), _unit_inner(k), _unit_inner(cos_sin_cache)
    n_tokens, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1]
    rot = cache.shape[-1]
    half = rot // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tail = head_dim - rot
    half_pad = triton.next_power_of_2(half)
    qh_pad = triton.next_power_of_2(n_q_heads)
    # The whole [heads, rot/2] q tile lives in registers: add warps as it grows.
    num_warps = min(16, max(4, qh_pad * half_pad // 1024))
    if n_tokens > 0:
        _rotary_kernel[(n_tokens,)](
            q, k, q_out, k_out, positions, cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
            n_q_heads, n_k_heads,
            HALF=half, HALF_PAD=half_pad, HEAD_DIM=head_dim,
            QH_PAD=qh_pad, KH_PAD=triton.next_power_of_2(n_k_heads),
            PASS_PAD=triton.next_power_of_2(tail) if tail > 0 else 0,
            num_warps=num_warps, **pdl.launch_options(q.device))
    return q_out, k_out


# --------------------------------------------------------------------------------------
# Dispatch (what model code calls)
# --------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return triton_rms_norm(x, weight, eps)
    if cpu_fused.applies(x, weight):
        return cpu_fused.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    if use_triton(x):
        return triton_fused_add_rms_norm(x, residual, weight, eps)
    if cpu_fused.applies(x, residual, weight):
        return cpu_fused.fused_add_rms_norm(x, residual, weight, eps)
    return torch_fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of last dim ``2*I``."""
    if use_triton(x):
        return triton_silu_and_mul(x)
    if cpu_fused.applies(x):
        return cpu_fused.silu_and_mul(x)
    return torch_silu_and_mul(x)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q ``[T, H, D]`` and k ``[T, Hkv, D]`` at ``positions``."""
    if use_triton(q):
        return triton_apply_rotary(q, k, positions, cos_sin_cache)
    if cpu_fused.applies(q, k, cos_sin_cache) and positions.dim() == 1:
        return cpu_fused.apply_rotary(q, k, positions, cos_sin_cache)
    return torch_apply_rotary(q, k, positions, cos_sin_cache)
