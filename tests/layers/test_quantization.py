"""Weight quantization: the kernels every format targets, the online int8/int4/fp8 methods'
error bounds against the float layer, and the config's refusals.

Error bounds. With round-to-nearest every dequantized weight is within half a step of the float
weight (``|w - w_hat| <= s / 2``), so an output ``y_n = sum_k x_k w_nk`` is within
``sum_k |x_k| s_nk / 2``. The CPU kernels also round the activations to bfloat16 (relative
error <= 2**-9), adding at most ``2**-9 * sum_k |x_k| |w_hat_nk|``; float32 accumulation adds
a negligible ``K * 2**-24`` relative term, covered by a 1% margin.
"""
from __future__ import annotations

import pytest
import torch

from pagoda.layers.quantization.kernels import (DequantLinear, Int4PackedCPU, Int8PackedCPU, dequantize_grouped,
                                                make_fp8_linear, make_int4_linear, make_int8_linear)
from pagoda.layers.quantization.online import quantize_fp8, quantize_int4, quantize_int8

BF16_EPS = 2.0 ** -9


def bound(x: torch.Tensor, w_hat: torch.Tensor, step_err: torch.Tensor) -> torch.Tensor:
    """Worst-case |y - x @ w.T| given per-weight error ``step_err`` [N, K] and bf16 activations."""
    ax = x.abs().double()
    return (ax @ step_err.double().T + BF16_EPS * ax @ w_hat.abs().double().T) * 1.01 + 1e-6


@pytest.mark.parametrize("group_size", [32, 64, 96, 128, 256, 768, 16])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int4_kernel_matches_dequantized_weight(group_size: int, rows: int) -> None:
    """Asymmetric integer zero points, any group size dividing K (96 splits into CPU groups of 32, whole row 768; 16 takes the
    dequant fallback): the kernel equals x @ dequantized(W).T up to bf16 activations."""
    g = torch.Generator().manual_seed(group_size + rows)
    n, k = 96, 768
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).float()
    lin = make_int4_linear(q, scales, zeros, group_size)
    assert isinstance(lin, Int4PackedCPU if group_size % 32 == 0 else DequantLinear)
    w_hat = dequantize_grouped(q, scales, zeros, group_size, torch.float64)
    x = torch.randn(rows, k, generator=g)
    ref = x.double() @ w_hat.T
    err = (lin(x, None).double() - ref).abs()
    assert (err <= bound(x, w_hat, torch.zeros_like(w_hat))).all(), err.max()


def test_int4_kernel_permutation_and_bias() -> None:
    """Act order: column j of q multiplies input column perm[j]."""
    g = torch.Generator().manual_seed(1)
    n, k, group = 64, 256, 64
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.05
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    perm = torch.randperm(k, generator=g)
    bias = torch.randn(n, generator=g)
    x = torch.randn(3, k, generator=g)
    w_hat = dequantize_grouped(q, scales, zeros, group, torch.float64)
    ref = x[:, perm].double() @ w_hat.T + bias.double()
    out = make_int4_linear(q, scales, zeros, group, perm=perm)(x, bias)
    assert ((out.double() - ref).abs() <= bound(x, w_hat, torch.zeros_like(w_hat))).all()


def test_int4_kernel_refuses_a_group_size_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="group size 100 does not divide 256"):
        make_int4_linear(torch.zeros(8, 256, dtype=torch.long), torch.ones(8, 2), None, 100)


def test_int8_kernels() -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 80, 192
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01
    x = torch.randn(4, k, generator=g)
    lin = make_int8_linear(q, scales)
    assert isinstance(lin, Int8PackedCPU)
    w_hat = q.double() * scales.double()[:, None]
    assert ((lin(x, None).double() - x.double() @ w_hat.T).abs() <= bound(x, w_hat, torch.zeros_like(w_hat))).all()
    # grouped with zero points: the dequantizing fallback, exact in float32
    gs = torch.rand(n, k // 64, generator=g) * 0.01
    zs = torch.randint(-8, 8, (n, k // 64), generator=g).float()
    lin = make_int8_linear(q, gs, zs, group_size=64)
    assert isinstance(lin, DequantLinear)
    w_hat = dequantize_grouped(q, gs, zs, 64, torch.float64)
    torch.testing.assert_close(lin(x, None).double(), x.double() @ w_hat.T, rtol=1e-5, atol=1e-5)


def test_online_int8_layer_error_bound() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * 0.05
    x = torch.randn(8, 256, generator=g)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    w_hat = q.double() * s.double()[:, None]
    assert ((w.double() - w_hat).abs() <= s.double()[:, None] / 2 * (1 + 1e-5)).all()  # half a step (+ the fp32 scale's rounding, times up to 15)
    out = make_int8_linear(q, s)(x, None)
    step = (s.double() / 2)[:, None].expand_as(w_hat)
    assert ((out.double() - x.double() @ w.double().T).abs() <= bound(x, w_hat, step)).all()


@pytest.mark.parametrize("group_size", [128, 64, 256])
def test_online_int4_layer_error_bound(group_size: int) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 512, generator=g) * 0.05
    x = torch.randn(8, 512, generator=g)
    q, s = quantize_int4(w, group_size)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    w_hat = dequantize_grouped(q, s, torch.full_like(s, 8.0), group_size, torch.float64)
    step = (s.double() / 2).repeat_interleave(group_size, dim=1)
    assert ((w.double() - w_hat).abs() <= step * (1 + 1e-5)).all()
    out = make_int4_linear(q, s, None, group_size)(x, None)
    assert ((out.double() - x.double() @ w.double().T).abs() <= bound(x, w_hat, step)).all()


def test_online_fp8_layer_error_bound() -> None:
    """e4m3 keeps 3 mantissa bits: a normal value is within 2**-4 of itself relatively, a
    subnormal (below 2**-6 in scaled units) within 2**-10 absolutely."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(8, 256, generator=g)
    w8, s = quantize_fp8(w)
    w_hat = w8.double() * s.double()[:, None]
    err = (w.double().abs() * 2.0 ** -4).maximum(s.double()[:, None] * 2.0 ** -10)
    assert ((w.double() - w_hat).abs() <= err + 1e-12).all()
    out = make_fp8_linear(w8, s)(x, None)
    ref = x.double() @ w.double().T
    bound_fp32 = (x.abs().double() @ err.T) * 1.01 + 1e-5  # fallback runs in float32, no bf16 rounding
    assert ((out.double() - ref).abs() <= bound_fp32).all()
