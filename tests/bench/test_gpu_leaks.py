"""``bench gpu all``'s stage selection and its leak report's holder chains (on CPU objects: the
report itself looks only at CUDA tensors)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from pagoda.bench import gpu_all, gpu_leaks


def test_stage_selection_keeps_order_and_the_device_stage():
    chosen = gpu_all.select_stages("async-scheduling, mla-decode")
    assert [s.name for s in chosen] == ["device", "mla-decode", "async-scheduling"]
    assert gpu_all.select_stages(None) == gpu_all.STAGES
    with pytest.raises(ValueError, match="unknown stages no-such-stage"):
        gpu_all.select_stages("smoke,no-such-stage")


class _Runner:
    def __init__(self) -> None:
        self.kv_cache = torch.zeros(4)


class _Engine:
    def __init__(self) -> None:
        self.runner = _Runner()


def test_holder_chain_names_the_attributes_and_the_module(monkeypatch):
    """A tensor kept by an engine that a module-level registry never let go of: the chain walks
    from the tensor to the registry's module."""
    module = types.ModuleType("pagoda_fake_registry")
    module.ENGINES = {"last": _Engine()}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    chain = gpu_leaks.holder_chain(module.ENGINES["last"].runner.kv_cache)
    assert chain == [f"{__name__}._Runner.kv_cache", f"{__name__}._Engine.runner", "dict['last']",
                     "module pagoda_fake_registry.ENGINES"], chain
    vars(module.ENGINES["last"].runner)  # the same chain once Python has made the object's __dict__
    assert gpu_leaks.holder_chain(module.ENGINES["last"].runner.kv_cache) == chain
    # A scan's own list of the tensors it found is not a holder.
    found = [module.ENGINES["last"].runner.kv_cache]
    assert gpu_leaks.holder_chain(found[0], skip=(found,)) == chain


def test_nothing_reported_without_cuda_or_below_the_limit():
    if torch.cuda.is_available():
        assert gpu_leaks.left_on_device(limit=1 << 60) is None
    else:
        assert gpu_leaks.device_bytes_in_use() is None and gpu_leaks.left_on_device(limit=0) is None
