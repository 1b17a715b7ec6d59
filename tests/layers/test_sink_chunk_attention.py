"""Attention sinks (gpt-oss) and chunked local attention (Llama 4) in every paged path: the torch
backend (prefill chunks, cached prefixes and decode groups) and the Triton decode (one split and
several, merged) and prefill kernels under the interpreter, against an fp64 reference that puts
each head's sink in the softmax denominator and hides keys outside a query's chunk."""
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
SINKS = torch.tensor([1.5, -2.0, 0.0, 3.0])  # four query heads; large enough to take weight


def _batch(request, query_lens, context_lens):
    batch = make_batch(_gen(request), query_lens, context_lens, 4, 2, 16, 8)
    batch.q.mul_(2.0)
    return batch


MIXED = [([1, 1, 9, 1], [40, 3, 20, 0]), ([23], [0]), ([1, 30], [70, 5]), ([1, 1, 1], [10, 70, 150])]
OPTIONS = [dict(sinks=SINKS), dict(chunk=6), dict(sinks=SINKS, chunk=16), dict(sinks=SINKS, window=7)]


def _run_torch(batch, sinks=None, chunk=None, window=None):
    return TorchAttentionBackend().forward(batch.q, batch.k_new, batch.v_new, batch.k_prefix.clone(),
                                           batch.v_prefix.clone(), batch.meta, batch.scale, sliding_window=window,
                                           sinks=sinks, attention_chunk_size=chunk)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("query_lens,context_lens", MIXED)
def test_torch_backend(request, options, query_lens, context_lens):
    batch = _batch(request, query_lens, context_lens)
    expected = reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, **options)
    assert_matches(_run_torch(batch, **options), expected, torch.float32)
    plain = reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, window=options.get("window"))
    assert (plain - expected).abs().max() > 1e-2  # the option matters in these batches


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("options", OPTIONS)
def test_triton_decode(request, options, num_splits):
    batch = _batch(request, [1, 1, 1], [10, 70, 150])
    expected = reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, **options)
    out = tk.paged_decode_attention(batch.q, batch.k_full, batch.v_full, batch.meta.block_tables,
                                    batch.meta.seq_lens, batch.scale, num_splits=num_splits,
                                    sliding_window=options.get("window"), sinks=options.get("sinks"),
                                    attention_chunk_size=options.get("chunk"))
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("query_lens,context_lens", MIXED[:3])
def test_triton_prefill(request, options, query_lens, context_lens):
    batch = _batch(request, query_lens, context_lens)
    expected = reference(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale, **options)
    out = tk.paged_prefill_attention(batch.q, batch.k_full, batch.v_full, batch.meta, batch.scale,
                                     block_m=16, block_n=16, sliding_window=options.get("window"),
                                     sinks=options.get("sinks"), attention_chunk_size=options.get("chunk"))
    assert_matches(out, expected, torch.float32)


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
