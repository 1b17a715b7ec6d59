"""The step message rank 0 broadcasts: packing and unpacking reproduce ``ModelInput`` exactly."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams
from pagoda.executor.input import ModelInput
from pagoda.executor.tp_worker import StepShape, pack_step, unpack_step


def _scheduled_inputs(llama_dir: Path) -> ModelInput:
    llm = LLM(str(llama_dir), kv_cache_memory=4 << 20, max_model_len=256, max_num_batched_tokens=40)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    engine.add_request("a", {"prompt_token_ids": list(range(10, 40))}, params)
    engine.add_request("b", {"prompt_token_ids": list(range(50, 75))}, SamplingParams(max_tokens=4))
    sched = engine.core.scheduler.schedule()  # "a" whole, "b" chunked by the 40-token budget
    inputs, _ = engine.core.executor.prepare(sched)
    return inputs


def test_step_round_trip_keeps_every_tensor_and_dtype(llama_dir):
    inputs = _scheduled_inputs(llama_dir)
    shape, flat = pack_step(inputs, [(3, 7), (4, 8)])
    assert flat.dtype == torch.int64 and flat.dim() == 1 and flat.numel() == sum(shape.sizes())
    got, copies = unpack_step(shape, flat, torch.device("cpu"))
    assert copies == [(3, 7), (4, 8)]
    for name in ("input_ids", "positions", "logits_indices"):
        want, have = getattr(inputs, name), getattr(got, name)
        assert have.dtype == want.dtype and torch.equal(have, want), name
    for f in dataclasses.fields(inputs.meta):
        want, have = getattr(inputs.meta, f.name), getattr(got.meta, f.name)
        if isinstance(want, torch.Tensor):
            assert have.dtype == want.dtype and torch.equal(have, want), f.name
        else:
            assert have == want, f.name


def test_copies_only_step_has_no_inputs():
    shape, flat = pack_step(None, [(1, 2)])
    assert shape == StepShape(num_copies=1)
    assert unpack_step(shape, flat, torch.device("cpu")) == (None, [(1, 2)])
