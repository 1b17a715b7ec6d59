"""Step inputs reach the device without waiting for it (``transfer.to_device``): under async
scheduling the next step is built while this one runs, and a blocking host-to-device copy would
hold the host until the step in flight ends. On CPU the copies are watched on the ``meta``
device (every copy from the host must be non-blocking); on CUDA the sync debug mode errors on
any synchronizing call."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagoda.executor import sampler
from pagoda.executor.input import build_model_input
from pagoda.transfer import to_device
from pagoda.sampling_params import SamplingParams

ROOT = Path(__file__).parents[2]


class HostCopies(TorchDispatchMode):
    """Records (non_blocking) for every copy from a CPU tensor to another device."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and out.device.type != "cpu":
            self.copies.append(bool(kwargs.get("non_blocking", False)))
        elif func is torch.ops.aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.copies.append(bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        return out


def test_the_watch_sees_a_blocking_copy():
    with HostCopies() as mode:
        torch.ones(3).to("meta")
        to_device(torch.ones(3), torch.device("meta"))
    assert mode.copies == [False, True]
    host = torch.ones(2)
    assert to_device(host, torch.device("cpu")) is host


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_step_inputs_are_sent_without_waiting(decode):
    meta = torch.device("meta")
    tables = [[3, 4], [7], [9, 10, 11]]
    if decode:
        args = ([5, 6, 7], [1, 1, 1], [20, 9, 40])
    else:
        args = ([5, 6, 7, 8, 9, 10], [3, 1, 2], [3, 9, 40])
    with HostCopies() as mode:
        inputs = build_model_input(args[0], args[1], args[2], tables, [0, 1, 2], meta, 16, [0, -1, 1])
    assert inputs.input_ids.device == meta and inputs.meta.block_tables.device == meta
    assert inputs.lora_slots is not None and inputs.lora_slots.device.type == "cpu"  # read on the host
    assert mode.copies and all(mode.copies), mode.copies


def test_sampling_tensors_are_sent_without_waiting():
    logits = torch.empty(3, 50, device="meta")
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
              SamplingParams(temperature=1.3, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=1.0)]
    rows = [sampler.SampleRow(p, None, [1, 2, 3], [4, 5], ()) for p in params]
    with HostCopies() as mode:
        sampler.apply_penalties(logits, rows)
        sampler.process_logits(logits, params)
    assert len(mode.copies) >= 8 and all(mode.copies), mode.copies


def test_async_worker_moves_host_inputs_without_waiting():
    """Async scheduling builds a step on the host and its worker moves it to the device behind
    the step in flight (``inputs_to_device``), placeholders filled there (``fill_placeholders``)."""
    from pagoda.engine.async_scheduling import fill_placeholders, inputs_to_device
    from pagoda.step import ModelOutput, SeqStepResult

    host = build_model_input([5, 6, 7], [1, 1, 1], [20, 9, 40], [[3, 4], [7], [9, 10, 11]], [0, 1, 2],
                             torch.device("cpu"), 16)
    with HostCopies() as mode:
        moved = inputs_to_device(host, torch.device("meta"))
        fill_placeholders(moved.input_ids, [1], ["a"], ModelOutput({"a": SeqStepResult([42])}))
    assert moved.input_ids.device.type == "meta" and moved.meta.block_tables.device.type == "meta"
    # A decode step's tensors are views of two host buffers: two copies, then the fill's two.
    assert mode.copies == [True] * 4, mode.copies
    assert moved.meta.block_tables.shape == host.meta.block_tables.shape
    assert inputs_to_device(host, torch.device("cpu")) is host


def test_deferred_sampling_indexes_rows_without_waiting():
    """The async path's samplers pick rows with index tensors sent ahead, not Python lists
    (indexing a CUDA tensor with a list copies it there and waits)."""
    logits = torch.empty(4, 50, device="meta")
    rows = [sampler.SampleRow(SamplingParams(temperature=t), None, [1], [2], ()) for t in (0.0, 0.8, 0.0, 1.2)]
    with HostCopies() as mode:
        sampler.Sampler.greedy_on_device(logits, [0, 2])
        sampler.sample_tokens(sampler.select_rows(logits, [0, 1, 3]), rows[:2] + rows[3:], None)
    assert len(mode.copies) >= 4 and all(mode.copies), mode.copies


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_views_of_one_buffer_move_in_one_copy(decode):
    from pagoda.executor.input import moved_together

    args = ([5, 6, 7], [1, 1, 1], [20, 9, 40]) if decode else ([5, 6, 7, 8, 9, 10], [3, 1, 2], [3, 9, 40])
    inputs = build_model_input(*args, [[3, 4], [7], [9, 10, 11]], [0, 1, 2], torch.device("cpu"), 16)
    m = inputs.meta
    tensors = [inputs.input_ids, inputs.positions, m.slot_mapping, m.query_start_loc, m.seq_lens, m.context_lens,
               m.block_tables, inputs.logits_indices]
    copied: list[torch.Tensor] = []
    out = moved_together(tensors, lambda t: copied.append(t) or t.clone())
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, out))
    assert all(o.data_ptr() != t.data_ptr() for o, t in zip(out, tensors))  # copies, not the host tensors
    if decode:
        assert len(copied) == 2  # the int64 buffer and the int32 one
        assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    else:
        assert len(copied) == len({id(t._base if t._base is not None else t) for t in tensors})


# The modules that build a step's tensors: none may make a device tensor from host values in one
# blocking call (``torch.tensor(values, device=...)``), which the watch above cannot see.
STEP_MODULES = ("pagoda/transfer.py", "pagoda/executor/input.py", "pagoda/executor/sampler.py", "pagoda/structured_output/bitmask.py",
                "pagoda/engine/async_scheduling.py")


@pytest.mark.parametrize("path", STEP_MODULES)
def test_no_blocking_tensor_construction_on_the_step_path(path):
    tree = ast.parse((ROOT / path).read_text())
    offenders = [node.lineno for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr in ("tensor", "as_tensor") and any(k.arg == "device" for k in node.keywords)]
    assert offenders == [], f"{path}: torch.tensor(..., device=...) at lines {offenders}; use to_device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU tests above watch the copies)")
def test_no_synchronizing_call_on_cuda():
    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy @ busy  # the device is still running this while the step is built
        build_model_input([5, 6, 7], [1, 1, 1], [20, 9, 40], [[3, 4], [7], [9, 10, 11]], [0, 1, 2], device, 16)
        build_model_input([5, 6, 7, 8], [3, 1], [3, 9], [[3], [7]], [2, 3], device, 16)
        logits = torch.randn(2, 50, device=device)
        sampler.process_logits(logits, [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
                                        SamplingParams(temperature=1.3)])
        sampler.Sampler.greedy_on_device(logits, [1])
        rows = [sampler.SampleRow(SamplingParams(temperature=t), None, [1], [2], ()) for t in (0.0, 0.9)]
        sampler.sample_tokens(sampler.select_rows(logits, [0, 1]), rows, None)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
