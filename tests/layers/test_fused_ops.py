"""Triton fused ops against their torch references (interpreter on CPU, compiled on CUDA)."""
from __future__ import annotations

import os
import zlib

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers import fused_ops as fo  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both paths compute in fp32 and round once; the interpreter rounds bf16 by truncation, so
# allow a couple of ulps of the output dtype.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: every case draws different, reproducible data."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any()
    tol = ATOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (3, 80), (2, 3, 96), (1, 5000)])
def test_rms_norm(request, dtype, shape):
    gen = _gen(request)
    x, w = _randn(gen, *shape, dtype=dtype), _randn(gen, shape[-1], dtype=dtype)
    _close(fo.triton_rms_norm(x, w, 1e-6), fo.torch_rms_norm(x, w, 1e-6))


def test_rms_norm_non_contiguous(request):
    gen = _gen(request)
    x = _randn(gen, 6, 3 * 64)[:, 64:128]  # a column slice, like q out of a fused qkv
    w = _randn(gen, 64)
    _close(fo.triton_rms_norm(x, w, 1e-5), fo.torch_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 64), (3, 96), (2, 2, 128)])
def test_fused_add_rms_norm(request, dtype, shape):
    gen = _gen(request)
    x, res = _randn(gen, *shape, dtype=dtype), _randn(gen, *shape, dtype=dtype)
    w = _randn(gen, shape[-1], dtype=dtype)
    x_before, res_before = x.clone(), res.clone()
    y, new_res = fo.triton_fused_add_rms_norm(x, res, w, 1e-6)
    y_ref, new_res_ref = fo.torch_fused_add_rms_norm(x, res, w, 1e-6)
    _close(new_res, new_res_ref)
    _close(y, y_ref)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 64), (2, 2, 2 * 96), (2, 2 * 1500)])
def test_silu_and_mul(request, dtype, shape):
    gen = _gen(request)
    x = _randn(gen, *shape, dtype=dtype) * 3
    _close(fo.triton_silu_and_mul(x), fo.torch_silu_and_mul(x))


def _rope_cache(gen: torch.Generator, max_pos: int, rot: int, dtype: torch.dtype) -> torch.Tensor:
    angles = torch.rand(max_pos, rot // 2, generator=gen) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot", [
    (4, 2, 64, 64), (3, 1, 80, 80), (2, 2, 96, 96), (8, 1, 128, 128), (4, 4, 128, 64),
])
def test_apply_rotary(request, dtype, heads, kv_heads, head_dim, rot):
    gen = _gen(request)
    tokens = 5
    qkv = _randn(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided views, as in the model
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(DEVICE)
    cache = _rope_cache(gen, 50, rot, dtype)
    q_out, k_out = fo.triton_apply_rotary(q, k, positions, cache)
    q_ref, k_ref = fo.torch_apply_rotary(q, k, positions, cache)
    _close(q_out, q_ref)
    _close(k_out, k_ref)


def test_torch_rotary_matches_complex_rotation(request):
    """Pins the reference itself: neox rotate-half equals multiplying (x1 + i*x2) by e^(i*theta)."""
    gen = _gen(request)
    q, k = _randn(gen, 3, 2, 8), _randn(gen, 3, 1, 8)
    angles = torch.rand(10, 4, generator=gen).to(DEVICE)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.tensor([0, 7, 3], device=DEVICE)
    q_out, _ = fo.torch_apply_rotary(q, k, positions, cache)
    z = torch.complex(q[..., :4], q[..., 4:]) * torch.polar(torch.ones_like(angles), angles)[positions][:, None]
    torch.testing.assert_close(q_out, torch.cat([z.real, z.imag], dim=-1))


def test_dispatch(monkeypatch, request):
    """CPU tensors take the torch path unless PAGODA_FORCE_TRITON=1."""
    gen = _gen(request)
    x, w = _randn(gen, 2, 64), _randn(gen, 64)
    calls = []
    real = fo.triton_rms_norm
    monkeypatch.setattr(fo, "triton_rms_norm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("PAGODA_FORCE_TRITON", raising=False)
    fo.rms_norm(x, w, 1e-6)
    assert calls == ([1] if HAS_CUDA else [])
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    _close(fo.rms_norm(x, w, 1e-6), fo.torch_rms_norm(x, w, 1e-6))
    assert calls


def test_dispatch_all_ops_forced(monkeypatch, request):
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    gen = _gen(request)
    x, r, w = _randn(gen, 3, 64), _randn(gen, 3, 64), _randn(gen, 64)
    for a, b in zip(fo.fused_add_rms_norm(x, r, w, 1e-6), fo.torch_fused_add_rms_norm(x, r, w, 1e-6)):
        _close(a, b)
    _close(fo.silu_and_mul(x), fo.torch_silu_and_mul(x))
    q, k = _randn(gen, 2, 2, 64), _randn(gen, 2, 1, 64)
    pos, cache = torch.tensor([1, 4], device=DEVICE), _rope_cache(gen, 8, 64, torch.float32)
    for a, b in zip(fo.apply_rotary(q, k, pos, cache), fo.torch_apply_rotary(q, k, pos, cache)):
        _close(a, b)


def test_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert fo.triton_rms_norm(x, w, 1e-6).shape == (0, 64)
    assert fo.triton_silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
