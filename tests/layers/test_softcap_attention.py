"""Attention logit soft-capping (Gemma 2) in every paged path that implements it: the torch
backend (prefill chunks, cached prefixes and decode groups) and the Triton decode and prefill
kernels under the interpreter, with and without a sliding window, against an fp64 reference
that caps the scores before masking. Scores are large enough that the cap changes them."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers.attention import triton_kernels as tk  # noqa: E402
from pagoda.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.layers.test_triton_attention import _gen, assert_matches, make_batch, reference  # noqa: E402

NEEDS_TRITON = True
CAP = 1.5


def capped_reference(q, k_cache, v_cache, meta, scale, softcap, window=None):
    return reference(q, k_cache, v_cache, meta, scale, softcap=softcap, window=window)


def _batch(request, query_lens, context_lens):
    batch = make_batch(_gen(request), query_lens, context_lens, 4, 2, 16, 8)
    batch.q.mul_(4.0)  # scores of several units: the cap bends them
    return batch


MIXED = [([1, 1, 9, 1], [40, 3, 20, 0]), ([23], [0]), ([1, 30], [70, 5]), ([1, 1, 1], [10, 70, 150])]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("query_lens,context_lens", MIXED)
def test_torch_backend_softcap(request, window, query_lens, context_lens):
    batch = _batch(request, query_lens, context_lens)
    expected = capped_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, CAP, window)
    out = TorchAttentionBackend().forward(batch.q, batch.k_new, batch.v_new, batch.k_prefix.clone(),
                                          batch.v_prefix.clone(), batch.meta, batch.scale, sliding_window=window,
                                          softcap=CAP)
    assert_matches(out, expected, torch.float32)
    uncapped = capped_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, 1e9, window)
    assert (uncapped - expected).abs().max() > 1e-2  # the cap matters in these batches


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 20])
def test_triton_decode_softcap(request, window, num_splits):
    batch = _batch(request, [1, 1, 1], [10, 70, 150])
    expected = capped_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, CAP, window)
    out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                    batch.meta.seq_lens, batch.scale, num_splits=num_splits,
                                    sliding_window=window, softcap=CAP)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("query_lens,context_lens", MIXED[:3])
def test_triton_prefill_softcap(request, window, query_lens, context_lens):
    batch = _batch(request, query_lens, context_lens)
    expected = capped_reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, CAP, window)
    out = tk.paged_prefill_attention(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale,
                                     block_m=16, block_n=16, sliding_window=window, softcap=CAP)
    assert_matches(out, expected, torch.float32)


def test_torch_backend_follows_metadata_moved_on_in_place(request):
    """A multi-step decoding round moves one metadata object on in place between its steps (new
    host-side length lists, the tensors updated): the torch backend's per-step plan must follow,
    or the group's key length and masks are those of the round's first step."""
    import dataclasses

    gen = _gen(request)
    batch = _batch(request, [1, 1], [10, 30])
    backend, page = TorchAttentionBackend(), batch.k_full.shape[1]
    k_cache, v_cache = batch.k_prefix.clone(), batch.v_prefix.clone()
    meta = batch.meta
    backend.forward(batch.q, batch.k_new, batch.v_new, k_cache, v_cache, meta, batch.scale, softcap=CAP)
    # The next step, in place: one more token per sequence.
    lens = [n + 1 for n in meta.seq_lens_cpu]
    tables = meta.block_tables
    meta.slot_mapping.copy_(torch.tensor([int(tables[b, (n - 1) // page]) * page + (n - 1) % page
                                          for b, n in enumerate(lens)]))
    meta.seq_lens.add_(1)
    meta.context_lens.add_(1)
    meta.seq_lens_cpu = lens
    meta.context_lens_cpu = [n - 1 for n in lens]
    meta.max_seq_len += 1
    q, k, v = (torch.randn(2, h, 16, generator=gen).to(batch.q.device) for h in (4, 2, 2))  # CUDA on a GPU
    fresh = dataclasses.replace(meta, query_lens_cpu=[1, 1], seq_lens_cpu=list(lens), query_start_loc_cpu=[],
                                context_lens_cpu=[])
    expected = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), fresh, batch.scale, softcap=CAP)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, batch.scale, softcap=CAP)
    torch.testing.assert_close(got, expected)


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
