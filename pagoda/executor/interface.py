"""What the engine core asks of an executor, and what the CUDA-graph and memory-profile code
ask of a local model runner. ``ModelRunner`` (one process) and ``TPExecutor`` (tensor-parallel
ranks) implement ``Executor``; the engine core and the draft-model proposer see only this."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pagoda.step import ModelOutput

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.executor.input import ModelInput
    from pagoda.executor.sampler import Sampler, SeedGenerators
    from pagoda.lora.manager import LoRAManager
    from pagoda.lora.request import LoRARequest
    from pagoda.models.decoder import DecoderForCausalLM
    from pagoda.step import SchedulerOutput


class Executor(Protocol):
    """Runs scheduled steps on a model. Call order: ``determine_num_blocks``,
    ``allocate_kv_cache`` (once), ``capture_cuda_graphs`` (once), then ``execute`` per step,
    and ``shutdown`` at the end. KV-cache figures are per rank. Sleep mode (``ModelRunner``
    only, one process): ``sleep(level)`` / ``wake_up()`` / ``reload_weights(config)`` release
    and rebuild the cache (and weights) between steps."""

    @property
    def generators(self) -> "SeedGenerators":
        """Seeded requests' generators (a draft proposer draws from the same ones)."""
        ...

    def determine_num_blocks(self) -> int:
        """How many KV-cache blocks fit the memory budget (profiled on a GPU)."""
        ...

    def kv_bytes_per_block(self) -> int:
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None:
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks in the allocated KV cache (0 before ``allocate_kv_cache``)."""
        ...

    def capture_cuda_graphs(self) -> None:
        """Capture decode CUDA graphs where they apply (a no-op elsewhere)."""
        ...

    def execute(self, sched: "SchedulerOutput") -> "ModelOutput":
        """Run one step: block copies, the forward pass, sampling and draft verification."""
        ...

    def shutdown(self) -> None:
        """Release worker processes and groups; idempotent."""
        ...

    def add_lora(self, request: "LoRARequest") -> None:
        """Load and check a LoRA adapter (``ValueError`` if it cannot be served); steps then
        place it in a slot when a scheduled sequence uses it."""
        ...

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (no running sequence may use it)."""
        ...


class StepPhases:
    """``execute`` as the three phases async scheduling also calls apart: ``begin_step`` (state of
    departed requests, block copies), ``prepare`` (the step's inputs and logits plan) and
    ``run_step`` (forward, sampling). ``ModelRunner`` and ``TPExecutor`` inherit it."""

    def execute(self, sched: "SchedulerOutput") -> ModelOutput:
        self.begin_step(sched)  # type: ignore[attr-defined]
        if sched.is_empty:
            return ModelOutput()
        inputs, plan = self.prepare(sched)  # type: ignore[attr-defined]
        return self.run_step(sched, inputs, plan)  # type: ignore[attr-defined]


class ModelHost(Protocol):
    """A model loaded in this process with its KV cache: what decode CUDA graphs and the GPU
    memory profile work on (``ModelRunner``)."""

    config: "EngineConfig"
    device: "torch.device"
    block_size: int
    model: "DecoderForCausalLM"
    kv_cache: "torch.Tensor | None"
    kv_scales: "torch.Tensor | None"
    sampler: "Sampler"
    lora: "LoRAManager | None"

    def allocate_kv_cache(self, num_blocks: int) -> None:
        ...

    def kv_bytes_per_block(self) -> int:
        ...

    def forward(self, inputs: "ModelInput") -> "torch.Tensor":
        ...
