"""pagoda: an LLM inference serving engine."""
from pagoda.config import EngineArgs
from pagoda.entrypoints.llm import LLM
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
__version__ = "0.1.0"
