"""MoE decode under CUDA graphs, checked on CPU: what a graph cannot hold is a read of a tensor's
values on the host (``.item()``, ``.tolist()``, a shape that depends on the data), since a
replay re-runs the kernels without the host code. The check runs a layer on fake tensors
(``FakeTensorMode``: shapes only, no values), with Triton launches recorded instead of run (a
launch reads only shapes and the grid): any host read of a value raises there. The torch path,
which reads each expert's token count, must fail it, and the GPU (Triton) path must pass.
Then the static-buffer decode step a graph captures (``DecodeGraphs(use_graphs=False)``) of a
Qwen2-MoE model (routed and shared experts) on the GPU code path must give the ordinary
forward's logits, its padding rows included."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first ``import triton`` (conftest.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from pagoda.layers.moe import FusedMoE, grouped_topk, softmax_topk  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early


@contextlib.contextmanager
def values_unreadable(monkeypatch) -> Iterator[FakeTensorMode]:
    """Tensors made inside hold shapes only; Triton launches are recorded in ``mode.launches``."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode.launches = []

    def record(self, *args, grid, warmup, **kwargs):
        mode.launches.append(getattr(self, "__name__", "kernel"))

    monkeypatch.setattr(interp.InterpretedFunction, "run", record)
    monkeypatch.setattr(jit.JITFunction, "run", record)
    with mode:
        yield mode


def _layer(experts: int = 6) -> FusedMoE:
    layer = FusedMoE(experts, 64, 32, torch.float32)
    torch.nn.init.normal_(layer.w13_weight)
    torch.nn.init.normal_(layer.w2_weight)
    return layer


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("routing", ["softmax", "grouped"])
def test_gpu_moe_path_reads_no_value_on_the_host(tokens, routing, monkeypatch):
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")  # the GPU code path on CPU tensors
    layer = _layer()
    x, logits = torch.randn(tokens, 64), torch.randn(tokens, 6)
    with values_unreadable(monkeypatch) as mode:
        xf, lf = mode.from_tensor(x), mode.from_tensor(logits)
        if routing == "softmax":
            weights, ids = softmax_topk(lf, 2, True)
        else:
            weights, ids = grouped_topk(lf, 2, 3, 2, mode.from_tensor(torch.zeros(6)), True, 2.5)
        out = layer(xf, weights, ids)
    assert out.shape == (tokens, 64)
    assert len(mode.launches) == 3  # two grouped GEMMs and the SiLU-and-mul between them


def test_the_check_catches_host_reads(monkeypatch):
    """The torch path reads each expert's token count (``bincount(...).tolist()``): the check
    must refuse it, or passing it above would mean nothing."""
    layer = _layer()
    with values_unreadable(monkeypatch) as mode:
        weights, ids = softmax_topk(mode.from_tensor(torch.randn(4, 6)), 2, True)
        with pytest.raises(Exception) as caught:
            layer._forward_grouped(mode.from_tensor(torch.randn(4, 64)), weights, ids)
    assert "Dynamic" in type(caught.value).__name__ or "DataDependent" in type(caught.value).__name__


# Families whose decode CUDA graphs hold MoE layers (and, for DeepSeek-V3, MLA; for Llama 4,
# chunked attention and per-slot expert passes; for gpt-oss, biased experts, sinks and windows).
CAPTURED = ("qwen2_moe", "deepseek_v3", "llama4", "gpt_oss")


def _gpu_path_runner(model_factory, monkeypatch, name: str):
    """A runner for ``name`` on the GPU code path (Triton attention, fused ops, grouped experts)."""
    from pagoda.layers.attention.triton_backend import TritonAttentionBackend
    from test_decode_graph_triton import _runner

    import test_decode_graph_triton

    monkeypatch.setenv("PAGODA_CPU_GEMM", "torch")  # experts left stacked, as on a GPU (not in CPU panels)
    if name == "gpt_oss":  # its checkpoint has 256 positions
        monkeypatch.setattr(test_decode_graph_triton, "MAX_LEN", 256)
    runner = _runner(model_factory(name))
    backend = TritonAttentionBackend()
    for layer in runner.model.attention_layers():
        layer.backend = backend
    return runner


@pytest.mark.parametrize("name", CAPTURED)
def test_decode_forward_reads_no_value_on_the_host(model_factory, monkeypatch, name):
    """A whole decode step of the model, as a graph of size 8 runs it (the static buffers'
    metadata), on fake tensors: it reads no value on the host anywhere (the same check refuses
    the CPU experts' path, ``test_the_check_catches_host_reads``)."""
    from pagoda.executor.cuda_graphs import DecodeGraphs
    from pagoda.layers.attention.context import forward_context

    runner = _gpu_path_runner(model_factory, monkeypatch, name)
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    buffers = DecodeGraphs(runner, use_graphs=False).buffers
    meta = buffers.metadata(8, runner.config.model.max_model_len)
    with torch.inference_mode(), values_unreadable(monkeypatch) as mode:
        for field in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables"):
            setattr(meta, field, mode.from_tensor(getattr(meta, field)))
        with forward_context(meta):
            hidden = runner.model(mode.from_tensor(buffers.input_ids[:8]), mode.from_tensor(buffers.positions[:8]))
    assert runner.model.cuda_graph_safe
    assert hidden.shape == (8, runner.config.model.hidden_size)
    assert "_grouped_gemm_kernel" in mode.launches
    if name == "deepseek_v3":
        assert {"_write_kv_kernel", "_mla_decode_kernel"} <= set(mode.launches)
    elif name == "llama4":  # its own attention forward (L2 norms after rotary) writes K/V apart
        assert "_write_kv_kernel" in mode.launches
    else:  # norms, rotary and the cache write in one launch (``triton_qkv.py``)
        assert "_prepare_qkv_kernel" in mode.launches and "_write_kv_kernel" not in mode.launches


# The families whose GPU layers are new to graphs (MLA and grouped routing; biased experts,
# sinks and windows); the host-read check above covers all of CAPTURED.
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_moe_static_buffer_decode_matches_ordinary_forward(model_factory, monkeypatch, name):
    """What a decode graph runs for an MoE model (Qwen2-MoE: routed experts and a sigmoid-gated
    shared expert; DeepSeek-V3: grouped routing, shared experts and MLA; Llama 4; gpt-oss), padded from 5
    sequences to the captured size 8, on the GPU code path (Triton attention, fused ops and
    grouped experts): the same logits as the ordinary forward."""
    from pagoda.executor.cuda_graphs import DecodeGraphs
    from pagoda.step import ScheduledSeq, SchedulerOutput
    from test_decode_graph_triton import _prefilled

    from pagoda.layers import moe_triton

    runner = _gpu_path_runner(model_factory, monkeypatch, name)
    assert runner.model.cuda_graph_safe
    calls: list[int] = []
    real = moe_triton.fused_experts
    monkeypatch.setattr(moe_triton, "fused_experts", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    seqs = _prefilled(runner, [30, 4, 7, 19, 12])
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 5))
    graphs = DecodeGraphs(runner, use_graphs=False)
    with torch.inference_mode():
        expected = runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices])
        got = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    sparse = len(calls) // 2  # the Triton expert calls of one forward (Llama 4: one per routed slot)
    assert sparse >= sum(isinstance(m, FusedMoE) for m in runner.model.modules()) > 0
    assert calls == [5] * sparse + [8] * sparse  # the Triton experts, on the batch and then on its padded size


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()


def test_a_failed_capture_leaves_decode_eager(monkeypatch, caplog):
    """Capture itself needs a GPU; what the engine does when it fails does not: it logs why and
    runs decode without graphs instead of failing to start."""
    import logging
    from types import SimpleNamespace

    from pagoda.executor import cuda_graphs

    class Refused:
        def __init__(self, runner, use_graphs):
            pass

        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", Refused)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 31))
    runner = SimpleNamespace(device=torch.device("cuda", 0), config=SimpleNamespace(enforce_eager=False),
                             model=SimpleNamespace(cuda_graph_safe=True))
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        assert cuda_graphs.capture_decode_graphs(runner) is None
    assert "decode runs eagerly" in caplog.text and "stream is capturing" in caplog.text
