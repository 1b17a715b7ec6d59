"""pagoda: an LLM inference serving engine."""
import os as _os

# CPU threads that spin while waiting turn any oversubscription (the API server, tokenizers,
# tensor-parallel ranks sharing cores) into order-of-magnitude slowdowns; sleeping waiters cost
# little when the machine is quiet. Must be set before torch starts its OpenMP runtime.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagoda.config import EngineArgs  # noqa: E402
from pagoda.entrypoints.llm import LLM  # noqa: E402
from pagoda.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
__version__ = "0.1.0"
