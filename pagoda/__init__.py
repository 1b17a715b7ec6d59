"""pagoda: an LLM inference serving engine.

Importing ``pagoda`` (or a light subpackage such as ``pagoda.scheduler`` / ``pagoda.kvcache``)
loads neither torch nor the engine and changes no environment variable: the public names below
are loaded on first access. Reaching for ``pagoda.LLM`` is the offline entry point, so it first
sets up OpenMP waiting (``pagoda.omp.configure_openmp``) before the engine imports torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.config import EngineArgs
    from pagoda.entrypoints.llm import LLM
    from pagoda.lora.request import LoRARequest
    from pagoda.outputs import CompletionOutput, RequestOutput
    from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "LoRARequest"]
__version__ = "0.1.0"

# name -> the module that defines it
_LAZY = {
    "LLM": "pagoda.entrypoints.llm",
    "SamplingParams": "pagoda.sampling_params",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "EngineArgs": "pagoda.config",
    "LoRARequest": "pagoda.lora.request",
    "OMP_DEFAULTS_SET": "pagoda.omp",  # what pagoda set, so benchmark peers can run without it
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    if name == "LLM":
        from pagoda.omp import configure_openmp

        configure_openmp()  # before the engine's import of torch starts its OpenMP runtime
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
