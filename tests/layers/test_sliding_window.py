"""Sliding-window attention in every paged path (torch backend, CPU C++ decode kernel, Triton
decode and prefill kernels under the interpreter) against an fp64 reference that masks keys
older than the window. The caches hold NaN outside each sequence's slots and the batches mix
decodes with prefill chunks that start before, inside and past the window."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.kernels import attention as cpu_kernel  # noqa: E402
from pagoda.kernels import select  # noqa: E402
from pagoda.layers.attention import triton_kernels as tk  # noqa: E402
from pagoda.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.layers.test_triton_attention import _gen, assert_matches, make_batch, quantize_cache, reference  # noqa: E402

NEEDS_TRITON = True


def windowed_reference(q, k_cache, v_cache, meta, scale, window):
    return reference(q, k_cache, v_cache, meta, scale, window=window)


def _poison_outside_window(batch, window):
    """NaN into every cached slot the window hides, so reading one fails the comparison."""
    page = batch.k_full.shape[1]
    tables = batch.meta.block_tables.cpu().long()
    for b, (q_len, seq_len) in enumerate(zip(batch.meta.query_lens_cpu, batch.meta.seq_lens_cpu)):
        first_visible = max(0, seq_len - q_len - window + 1)
        for p in range(first_visible):
            for cache in (batch.k_full, batch.v_full):
                cache[tables[b, p // page], p % page] = float("nan")


MIXED = [([1, 1, 9, 1], [40, 3, 20, 0]), ([23], [0]), ([1, 30], [70, 5]), ([12, 1], [0, 130])]


@pytest.mark.parametrize("window", [1, 7, 16])
@pytest.mark.parametrize("query_lens,context_lens", MIXED)
def test_torch_backend_window(request, window, query_lens, context_lens):
    batch = make_batch(_gen(request), query_lens, context_lens, 4, 2, 16, 8)
    expected = windowed_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, window)
    out = TorchAttentionBackend().forward(batch.q, batch.k_new, batch.v_new, batch.k_prefix.clone(),
                                          batch.v_prefix.clone(), batch.meta, batch.scale, sliding_window=window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("window", [1, 5, 33])
def test_cpu_decode_kernel_window(request, window):
    if not select.kernels_enabled():
        pytest.skip("PAGODA_CPU_KERNELS=0")
    batch = make_batch(_gen(request), [1, 1, 1, 1], [0, 4, 50, 200], 6, 2, 16, 16)
    _poison_outside_window(batch, window)
    expected = windowed_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, window)
    out = cpu_kernel.paged_decode(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                  batch.meta.seq_lens, batch.scale, window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 20, 64])
def test_triton_decode_window(request, window, num_splits):
    batch = make_batch(_gen(request), [1, 1, 1], [10, 70, 150], 4, 2, 16, 8)
    _poison_outside_window(batch, window)
    expected = windowed_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, window)
    out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                    batch.meta.seq_lens, batch.scale, num_splits=num_splits,
                                    sliding_window=window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("window", [3, 40])
@pytest.mark.parametrize("query_lens,context_lens", MIXED)
def test_triton_prefill_window(request, window, query_lens, context_lens):
    batch = make_batch(_gen(request), query_lens, context_lens, 4, 2, 16, 8)
    _poison_outside_window(batch, window)
    expected = windowed_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, window)
    out = tk.paged_prefill_attention(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale,
                                     block_m=16, block_n=16, sliding_window=window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_window_over_quantized_cache(request, dtype):
    """A sliding window over an int8/fp8 cache (whose hidden slots hold NaN scales): the C++
    decode kernel and the Triton decode and prefill kernels against the windowed reference
    over the dequantized cache."""
    window = 20
    gen = _gen(request)
    decode = make_batch(gen, [1, 1, 1], [10, 70, 150], 4, 2, 16, 8)
    mixed = make_batch(gen, [9, 1, 30], [40, 70, 5], 4, 2, 16, 8)
    for batch in (decode, mixed):
        _poison_outside_window(batch, window)
        cache = quantize_cache(batch.k_full, batch.v_full, dtype)
        k_ref, v_ref = cache.dequantized()
        expected = windowed_reference(batch.q, k_ref, v_ref, batch.meta, batch.scale, window)
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        out = tk.paged_prefill_attention(batch.q, cache.k, cache.v, batch.meta, batch.scale, block_m=16,
                                         block_n=16, sliding_window=window, **scales)
        assert_matches(out, expected, torch.float32)
        if batch is decode:
            out = tk.paged_decode_attention(batch.q, cache.k, cache.v, batch.meta.block_tables,
                                            batch.meta.seq_lens, batch.scale, num_splits=2,
                                            sliding_window=window, **scales)
            assert_matches(out, expected, torch.float32)
            if cpu_kernel.load() is not None:
                out = cpu_kernel.paged_decode(batch.q, cache.k, cache.v, batch.meta.block_tables,
                                              batch.meta.seq_lens, batch.scale, window, **scales)
                assert_matches(out, expected, torch.float32)


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
