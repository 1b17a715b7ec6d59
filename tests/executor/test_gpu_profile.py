"""The KV-cache budget: the arithmetic and the error on CPU, the profiling step's shapes on a
CPU runner, the measurement itself on CUDA only."""
from __future__ import annotations

import logging

import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.executor.gpu_profile import (MemoryProfile, _dummy_step, _temporary_kv_cache, blocks_for, dummy_shape,
                                         kv_budget)
from pagoda.executor.model_runner import ModelRunner

GiB = 2**30
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_kv_budget_arithmetic():
    # 80 GiB at 0.9 = 72 GiB; minus 16 weights, 4 activations, 1 outside torch.
    assert kv_budget(80 * GiB, 0.9, 16 * GiB, 4 * GiB, 1 * GiB) == 51 * GiB
    assert kv_budget(100, 1.0, 10, 20, 30) == 40
    assert kv_budget(100, 0.5, 40, 20, 0) == -10


def test_blocks_for_buys_whole_blocks():
    profile = MemoryProfile(total=1000, utilization=1.0, weights=100, peak_activation=100, non_torch=50)
    assert profile.budget == 750
    assert blocks_for(profile, bytes_per_block=100, block_size=16, max_model_len=64, max_num_batched_tokens=256) == 7


@pytest.mark.parametrize("utilization,weights", [(0.3, 20 * GiB), (0.9, 70 * GiB)])
def test_too_little_memory_names_the_numbers(utilization, weights):
    profile = MemoryProfile(total=80 * GiB, utilization=utilization, weights=weights,
                            peak_activation=3 * GiB, non_torch=GiB // 2)
    with pytest.raises(ValueError) as err:
        blocks_for(profile, bytes_per_block=2 * 2**20, block_size=16, max_model_len=131072,
                   max_num_batched_tokens=8192)
    text = str(err.value)
    assert f"{utilization:.2f} x 80.00 GiB total" in text
    assert f"weights {weights / GiB:.2f} GiB" in text and "peak activations 3.00 GiB" in text
    assert "outside torch 0.50 GiB" in text and "max_model_len 131072 needs 8192 blocks" in text
    for remedy in ("--gpu-memory-utilization", "--max-model-len", "--max-num-batched-tokens", "--kv-cache-memory"):
        assert remedy in text


def test_dummy_shape_spreads_the_budget():
    assert dummy_shape(8192, 256, 4096) == [32] * 256
    assert dummy_shape(10, 4, 100) == [3, 3, 2, 2]
    assert dummy_shape(100, 256, 4096) == [1] * 100  # never more sequences than tokens
    assert dummy_shape(8192, 1, 2048) == [2048] * 4  # nor a sequence beyond max_model_len


def test_dummy_step_runs_and_restores_the_cache(llama_dir):
    """The profiling step on a CPU runner: full-size shapes through a one-block cache, which
    is gone afterwards."""
    args = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=256, max_num_batched_tokens=300,
                      max_num_seqs=7)
    runner = ModelRunner(EngineConfig.from_args(args))
    layer = runner.model.attention_layers()[0]
    before = layer.k_cache
    with _temporary_kv_cache(runner):
        assert runner.kv_cache is not None and runner.kv_cache.shape[2] == 1
        _dummy_step(runner)
    assert runner.kv_cache is None and layer.k_cache is before


@cuda_only
def test_profile_sizes_the_cache_on_cuda(llama_dir, caplog):
    from pagoda import LLM

    with caplog.at_level(logging.INFO, logger="pagoda.executor.gpu_profile"):
        llm = LLM(str(llama_dir), device="cuda", gpu_memory_utilization=0.3, max_model_len=512)
    assert any("KV cache budget" in r.getMessage() for r in caplog.records)
    free, total = torch.cuda.mem_get_info()
    # The cache took roughly what was left of 30% of the device, never more.
    assert torch.cuda.memory_reserved() <= 0.3 * total + 2**28
    llm.shutdown()


@cuda_only
def test_profile_refuses_a_tiny_utilization(llama_dir):
    from pagoda import LLM

    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        LLM(str(llama_dir), device="cuda", gpu_memory_utilization=0.001, max_model_len=512)
