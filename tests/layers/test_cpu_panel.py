"""The panel kernel (``pagoda.kernels.panel``) for decode products: float32 sums of
``F.linear``'s products (of the bfloat16-rounded rows, over bfloat16 panels) for any shape (a
partial last panel, any ``K``, odd ones for the bfloat16 pairs, row tiles of eight and the rest),
each row's result independent of the rest of the batch, and its place in ``cpu_gemm``: chosen
per layer, serving up to ``MAX_ROWS`` rows, the dense copy dropped, ``PAGODA_CPU_GEMM=panel``
honoured (for bfloat16 layers too, which take AMX where the CPU has it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import panel as cpu_panel
from pagoda.layers import cpu_gemm
from pagoda.layers.linear import ReplicatedLinear

needs_panel = pytest.mark.skipif(not cpu_panel.supported(), reason="no AVX2 or AVX-512 here")
needs_bf16_panel = pytest.mark.skipif(not cpu_panel.supported(torch.bfloat16), reason="no AVX512-BF16 here")


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = (x.double() @ w.double().T).float()
    # float32 sums of float32 products: a few float32 ulps of the sum of magnitudes
    bound = 1e-6 * (x.abs() @ w.abs().T) + 1e-6
    assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()


@needs_panel
@pytest.mark.parametrize("shape", [(1024, 512), (40, 70), (16, 1), (100, 3), (48, 64), (7, 33)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 31, 32, 33, 70])
def test_kernel_matches_the_float32_products(shape, rows) -> None:
    torch.manual_seed(rows)
    n, k = shape
    w, x = torch.randn(n, k), torch.randn(rows, k)
    got = cpu_panel.linear_op()(x, cpu_panel.pack(w), n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    _check(got, x, w)


@needs_panel
def test_strided_rows_and_empty_products() -> None:
    torch.manual_seed(0)
    w = torch.randn(50, 24)
    packed = cpu_panel.pack(w)
    wide = torch.randn(5, 40)
    x = wide[:, 3:27]  # rows with a stride of 40
    _check(cpu_panel.linear_op()(x, packed, 50), x, w)
    assert cpu_panel.linear_op()(torch.randn(0, 24), packed, 50).shape == (0, 50)
    with pytest.raises(RuntimeError, match="packed weight"):
        cpu_panel.linear_op()(torch.randn(2, 25), packed, 50)


@needs_panel
def test_a_row_does_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    packed = cpu_panel.pack(w)
    x = torch.randn(cpu_panel.MAX_ROWS, 96)
    full = cpu_panel.linear_op()(x, packed, 200)
    for rows in (1, 3, 8, 9, 16, 19):
        assert torch.equal(cpu_panel.linear_op()(x[:rows], packed, 200), full[:rows])
    assert torch.equal(cpu_panel.linear_op()(x[13:14], packed, 200), full[13:14])


@needs_panel
def test_wrapper_adds_the_bias_and_keeps_leading_dims() -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(40, 64), torch.randn(40)
    x = torch.randn(2, 3, 64)
    y = cpu_panel.linear(x, cpu_panel.pack(w), 40, bias)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, F.linear(x, w, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_uses_the_panels_up_to_max_rows_and_onednn_beyond(monkeypatch, dtype) -> None:
    """``PAGODA_CPU_GEMM=panel``: float32 panels, or bfloat16 ones (``[P, K/2, 16, 2]``; what a
    bfloat16 layer takes by default where the CPU has no AMX) for up to ``MAX_ROWS`` rows."""
    if not cpu_panel.supported(dtype):
        pytest.skip(f"no panel kernel for {dtype} here (AVX2 or AVX-512 / AVX512-BF16)")
    if not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "panel")
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 48, True, dtype)
    layer.weight.data.normal_(0, 0.1)
    layer.bias.data.normal_(0, 0.1)
    dense = layer.weight.data.clone()
    assert layer.pack_weight()
    assert layer.weight.numel() == 0  # the panels replace the dense copy
    tiles = layer.packed.pagoda_tiles
    assert tiles.dtype == dtype and tiles.dim() == (3 if dtype == torch.float32 else 4)
    assert layer.packed.pagoda_tiles_kernel is cpu_panel and layer.packed.pagoda_tiles_rows == cpu_panel.MAX_ROWS
    calls = []
    real = cpu_panel.linear
    monkeypatch.setattr(cpu_panel, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (0, 1, 4, 9, cpu_panel.MAX_ROWS, cpu_panel.MAX_ROWS + 1, 80):
        x = torch.randn(rows, 64).to(dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), dense.float(), layer.bias.data.float()),
                                   rtol=tol, atol=tol)
    assert calls == [1, 4, 9, cpu_panel.MAX_ROWS]


def test_panel_mode_fails_loudly_where_the_kernel_cannot_run(monkeypatch) -> None:
    if not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "panel")
    monkeypatch.setattr(cpu_panel, "supported", lambda dtype=torch.float32: False)
    layer = ReplicatedLinear(64, 48, False, torch.float32)
    with pytest.raises(RuntimeError, match="PAGODA_CPU_GEMM=panel"):
        layer.pack_weight()


def test_other_modes_never_choose_the_panels(monkeypatch) -> None:
    if not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    for mode in ("onednn", "gemv", "amx"):
        monkeypatch.setenv(cpu_gemm.ENV_VAR, mode)
        monkeypatch.setitem(cpu_gemm._TILE_CHOICE, (torch.float32, 48, 64), cpu_panel.MAX_ROWS)
        layer = ReplicatedLinear(64, 48, False, torch.float32)
        assert layer.pack_weight()
        assert (getattr(layer.packed, "pagoda_tiles", None) is None) == (mode != "amx")  # amx mode: float32 as auto


@needs_bf16_panel
@pytest.mark.parametrize("shape", [(1024, 512), (40, 70), (16, 1), (100, 3), (7, 33)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_panels_match_the_bfloat16_products(shape, rows, dtype) -> None:
    torch.manual_seed(rows)
    n, k = shape
    w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(rows, k).to(dtype)
    packed = cpu_panel.pack(w)
    got = cpu_panel.linear_op()(x, packed, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    _check(got, x.to(torch.bfloat16).float(), w.float())
    assert torch.equal(cpu_panel.linear_op()(x[:1], packed, n), got[:1])  # a row alone, the same bits
    y = cpu_panel.linear(x, packed, n, None)
    assert y.dtype == dtype and torch.equal(y, got.to(dtype))


def test_bfloat16_tiles_are_amx_where_the_cpu_has_it(monkeypatch) -> None:
    """By default a bfloat16 layer's tile kernel is AMX where it runs, else the bfloat16 panels."""
    from pagoda.kernels import amx as cpu_amx

    for amx in (True, False):
        monkeypatch.setattr(cpu_amx, "supported", lambda amx=amx: amx)
        kernel = cpu_gemm._tile_kernel(torch.bfloat16, "auto")
        assert kernel is not None and kernel[0] is (cpu_amx if amx else cpu_panel) and not kernel[1]
    assert cpu_gemm._tile_kernel(torch.bfloat16, "panel")[:2] == (cpu_panel, True)
    assert cpu_gemm._tile_kernel(torch.bfloat16, "amx")[:2] == (cpu_amx, True)
    assert cpu_gemm._tile_kernel(torch.float32, "amx")[:2] == (cpu_panel, False)
    assert cpu_gemm._tile_kernel(torch.float16, "auto") is None
