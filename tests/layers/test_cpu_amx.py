"""The AMX bfloat16 kernel (``pagoda.kernels.amx``) for batched-decode products: the sums of
``F.linear`` on bfloat16-rounded rows, any shape (padding of rows, features and ``K``), each row's
result independent of the rest of the batch, and its place in ``cpu_gemm``: chosen per layer,
serving up to ``MAX_ROWS`` rows, the dense copy dropped, ``PAGODA_CPU_GEMM=amx`` honoured."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import amx as cpu_amx
from pagoda.kernels import select
from pagoda.layers import cpu_gemm
from pagoda.layers.linear import ReplicatedLinear

needs_amx = pytest.mark.skipif(select.isa().level != "amx", reason="no AMX-BF16 here")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact products of the bfloat16 values, summed in float64."""
    return (x.to(torch.bfloat16).double() @ w.double().T).float()


@needs_amx
@pytest.mark.parametrize("shape", [(64, 512), (1000, 500), (37, 70), (16, 32)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_bfloat16_products(shape, rows, dtype) -> None:
    torch.manual_seed(rows)
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(rows, k).to(dtype)
    got = cpu_amx.linear_op()(x, cpu_amx.pack(w), n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    ref = _reference(x, w)
    # float32 sums of exact products: a few float32 ulps of the sum of magnitudes
    bound = 1e-6 * (x.to(torch.bfloat16).float().abs() @ w.float().abs().T) + 1e-6
    assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()


@needs_amx
def test_a_row_does_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 200).to(torch.bfloat16)
    tiles = cpu_amx.pack(w)
    x = torch.randn(cpu_amx.MAX_ROWS, 200)
    full = cpu_amx.linear_op()(x, tiles, 96)
    for rows in (1, 3, 16, 19):
        assert torch.equal(cpu_amx.linear_op()(x[:rows], tiles, 96), full[:rows])
    assert torch.equal(cpu_amx.linear_op()(x[7:8], tiles, 96), full[7:8])


@needs_amx
def test_wrapper_keeps_the_dtype_and_adds_the_bias() -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(40, 64).to(torch.bfloat16), torch.randn(40)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    y = cpu_amx.linear(x, cpu_amx.pack(w), 40, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 40)
    torch.testing.assert_close(y.float(), (_reference(x.reshape(6, 64), w) + bias).reshape(2, 3, 40).to(torch.bfloat16).float())


@needs_amx
def test_layer_uses_amx_up_to_max_rows_and_onednn_beyond(monkeypatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "amx")
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 48, False, torch.bfloat16)
    layer.weight.data.normal_(0, 0.1)
    dense = layer.weight.data.clone()
    assert layer.pack_weight()
    assert layer.weight.numel() == 0  # the tiles replace the dense copy
    assert getattr(layer.packed, "pagoda_tiles", None) is not None
    calls = []
    real = cpu_amx.linear
    monkeypatch.setattr(cpu_amx, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (0, 1, 4, cpu_amx.MAX_ROWS, cpu_amx.MAX_ROWS + 1, 80):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), dense.float()), rtol=2e-2, atol=2e-2)
    assert calls == [1, 4, cpu_amx.MAX_ROWS]


def test_amx_mode_fails_loudly_where_the_kernel_cannot_run(monkeypatch) -> None:
    if not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "amx")
    monkeypatch.setattr(cpu_amx, "supported", lambda: False)
    layer = ReplicatedLinear(64, 48, False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="PAGODA_CPU_GEMM=amx"):
        layer.pack_weight()
    # float32 layers never take the AMX kernel, whatever the mode
    fp32 = ReplicatedLinear(64, 48, False, torch.float32)
    assert fp32.pack_weight()
    tiles = getattr(fp32.packed, "pagoda_tiles", None)
    assert tiles is None or tiles.dtype == torch.float32  # the float32 panel kernel's, if timed the winner


def test_other_modes_never_choose_amx(monkeypatch) -> None:
    if not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    # oneDNN packs bfloat16 only with AVX512-BF16 or AMX: on an AVX2 CPU the layer keeps F.linear.
    packable = cpu_gemm.pack(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None
    for mode in ("onednn", "gemv"):
        monkeypatch.setenv(cpu_gemm.ENV_VAR, mode)
        layer = ReplicatedLinear(64, 48, False, torch.bfloat16)
        assert layer.pack_weight() == packable and getattr(layer.packed, "pagoda_tiles", None) is None
