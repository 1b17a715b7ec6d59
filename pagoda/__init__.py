"""pagoda: an LLM inference serving engine."""
import os as _os

# How OpenMP worker threads wait between parallel regions, set before torch starts its runtime
# (users' own OMP_WAIT_POLICY / GOMP_SPINCOUNT win). A short spin (about ten microseconds)
# bridges the gaps between the ops of one forward pass, which otherwise pay a thread wake-up per
# matmul; long spinning would turn any oversubscription (the API server, tokenizers,
# tensor-parallel ranks sharing cores) into order-of-magnitude slowdowns. Processes pagoda spawns
# next to others (the server's engine core, tensor-parallel workers) sleep at once instead: see
# ``pagoda.omp``.
OMP_DEFAULTS_SET: dict[str, str] = {}  # what pagoda set, so benchmark peers can run without it
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    OMP_DEFAULTS_SET["GOMP_SPINCOUNT"] = _os.environ["GOMP_SPINCOUNT"] = "10000"

from pagoda.config import EngineArgs  # noqa: E402
from pagoda.entrypoints.llm import LLM  # noqa: E402
from pagoda.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
__version__ = "0.1.0"
