"""Programmatic dependent launch (layers/pdl.py): where the decode kernels launch with it. Its
kernels' PTX is checked in test_hopper_builds.py; on CPU they run under the interpreter
without it, as the GPU path's own tests run them."""
from __future__ import annotations

import pytest
import torch

from pagoda.layers import pdl


@pytest.fixture
def compiling(monkeypatch):
    """Triton compiling, not interpreting (as on a GPU host)."""
    from pagoda.kernels.triton_import import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)


@pytest.mark.parametrize("value, asked", [(None, False), ("0", False), ("1", True), ("on", True), ("no", False)])
def test_the_switch_is_off_unless_asked(monkeypatch, value, asked):
    if value is None:
        monkeypatch.delenv(pdl.ENV, raising=False)
    else:
        monkeypatch.setenv(pdl.ENV, value)
    assert pdl.requested() is asked


def test_hopper_and_later_launch_with_it_when_asked(monkeypatch, compiling):
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv(pdl.ENV, "1")
    for capability, expected in (((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)):
        monkeypatch.setattr(pdl, "_capability", lambda index, c=capability: c)
        assert pdl.enabled(cuda) is expected
        assert pdl.launch_options(cuda) == ({"PDL": True, "launch_pdl": True} if expected else {})
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.launch_options(cuda) == {}


def test_never_on_cpu_or_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    assert pdl.launch_options(torch.device("cpu")) == {}
    from pagoda.kernels.triton_import import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    assert pdl.launch_options(torch.device("cuda", 0)) == {}


def test_kernels_take_the_switch_and_run_without_it_here():
    """Each kernel of the decode path declares ``PDL`` (default off); called on CPU tensors under
    the interpreter with the launch options this host gives (none), they compute as before."""
    from pagoda.layers import fused_ops, skinny_gemm
    from pagoda.layers.attention import triton_kernels, triton_qkv

    kernels = (triton_kernels._decode_kernel, triton_kernels._merge_splits_kernel, triton_kernels._write_kv_kernel,
               triton_qkv._prepare_qkv_kernel, fused_ops._rms_norm_kernel, fused_ops._silu_and_mul_kernel,
               fused_ops._rotary_kernel, skinny_gemm._gemv_kernel, skinny_gemm._norm_gemv_kernel,
               skinny_gemm._reduce_kernel, skinny_gemm._skinny_kernel)
    for kernel in kernels:
        assert kernel.arg_names[-1] == "PDL", kernel.fn.__name__
    assert pdl.launch_options(torch.device("cpu")) == {}
    x = torch.randn(1, 64)
    w = torch.randn(48, 64)
    config = skinny_gemm.GEMV_CONFIGS[0]._replace(split_k=2)  # the one-row kernel and its split-K reduce
    torch.testing.assert_close(skinny_gemm.skinny_matmul(x, w, None, config), x @ w.T, rtol=1e-4, atol=1e-4)
