"""MLA on the GPU code path: DeepSeek-V3's latent attention through the Triton attention
backend (prefill kernel, then the MLA decode kernel over the paged latent cache, under the
interpreter on CPU) gives the torch backend's logits, and its cache is one latent plane."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.layers.attention import triton_backend  # noqa: E402
from pagoda.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagoda.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagoda.step import ScheduledSeq, SchedulerOutput  # noqa: E402
from tests.layers.test_decode_graph_triton import _prefilled, _runner  # noqa: E402

NEEDS_TRITON = True


def _decode_logits(runner, seqs) -> torch.Tensor:
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 0))
    with torch.inference_mode():
        return runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices])


def test_mla_triton_backend_matches_torch(model_factory, monkeypatch):
    runner = _runner(model_factory("deepseek_v3"))
    latent_decodes: list[tuple[int, ...]] = []
    real = triton_backend.paged_mla_decode_attention
    monkeypatch.setattr(triton_backend, "paged_mla_decode_attention",
                        lambda q, *a, **k: latent_decodes.append(tuple(q.shape)) or real(q, *a, **k))
    layers = runner.model.attention_layers()
    assert runner.kv_cache.shape[1] == 1 and layers[0].k_cache.data_ptr() == layers[0].v_cache.data_ptr()
    assert tuple(runner.kv_cache.shape[-2:]) == (1, 24 + 8)
    lens = [24, 3, 40]
    for layer in layers:
        layer.backend = TorchAttentionBackend()
    expected = _decode_logits(runner, _prefilled(runner, lens))
    runner.kv_cache.zero_()
    for layer in layers:
        layer.backend = TritonAttentionBackend(decode_num_splits=2)
    got = _decode_logits(runner, _prefilled(runner, lens))  # prefill and decode both on Triton
    # Every layer's decode ran the latent kernel: 3 rows of all heads, [c_kv | k_pe] wide.
    assert latent_decodes == [(3, layers[0].num_heads, 24 + 8)] * len(layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_decode_graphs_pin_mla_splits_from_its_head_tiles(model_factory, monkeypatch):
    """A decode graph pins the latent kernel's split count from the programs a sequence spreads
    over (its head tiles), as the eager planner does, not from the one KV head; and the static
    path gives the eager forward's logits."""
    from pagoda.executor.cuda_graphs import DecodeGraphs
    from pagoda.layers.attention import triton_kernels as tk
    from pagoda.layers.attention import triton_mla

    runner = _runner(model_factory("deepseek_v3"))
    seqs = _prefilled(runner, [24, 3, 40])
    backend = TritonAttentionBackend()
    layers = runner.model.attention_layers()
    for layer in layers:
        layer.backend = backend
    splits: list[int] = []
    real = triton_backend.paged_mla_decode_attention
    monkeypatch.setattr(triton_backend, "paged_mla_decode_attention",
                        lambda *a, **k: splits.append(k["num_splits"]) or real(*a, **k))
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 0))
    graphs = DecodeGraphs(runner, use_graphs=False)
    with torch.inference_mode():
        expected = runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices])
        got = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
    assert layers[0].decode_programs == triton_mla.mla_head_blocks(layers[0].num_heads)
    sms = tk._device_sm_count(runner.device)
    pinned = tk.choose_num_splits(4, layers[0].decode_programs, runner.config.model.max_model_len, sms)
    assert splits == [None] * len(layers) + [pinned] * len(layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # DeepSeek-V3's 128 heads make several tiles; stand in a count that changes the plan: the pin
    # follows the tiles (one KV head would plan more splits).
    monkeypatch.setattr(triton_mla, "mla_head_blocks", lambda heads: 100)
    few = tk.choose_num_splits(4, 100, runner.config.model.max_model_len, sms)
    assert few != tk.choose_num_splits(4, layers[0].num_kv_heads, runner.config.model.max_model_len, sms)
    splits.clear()
    with torch.inference_mode():
        got = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
    assert splits == [few] * len(layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # any split count is correct
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
