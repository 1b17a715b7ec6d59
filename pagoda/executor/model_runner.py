"""Turns a scheduled batch into tensors, runs the model and samples.

``execute(SchedulerOutput) -> ModelOutput`` is the whole contract with the engine (the
``Executor`` protocol). The inputs come from ``executor.input``; sampling and draft
verification run the one sampling pipeline of ``executor.sampler``.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import time
from typing import TYPE_CHECKING, Callable

import torch

from pagoda.config import CPU_DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagoda.distributed.parallel_state import set_expert_parallel
from pagoda.executor.cuda_graphs import DecodeGraphs, capture_decode_graphs
from pagoda.executor.input import LogitsPlan, ModelInput, PlanEntry, build_model_input, prepare_model_input
from pagoda.executor.interface import StepPhases
from pagoda.executor.isolation import RngSnapshot, describe, run_rows
from pagoda.executor.rejection import DraftRow, Verdict, verify
from pagoda.executor.sampler import (DeviceTokens, SampleRow, Sampler, SamplerOutput, SeedGenerators,
                                     plain_greedy_params, prompt_logprobs, sample_row, select_rows)
from pagoda.kernels import fused as cpu_fused
from pagoda.layers import cpu_gemm
from pagoda.layers.attention import kv_quant
from pagoda.layers.attention.context import forward_context
from pagoda.models import cpu_decode
from pagoda.models.loader import load_model
from pagoda.multimodal.encoder_cache import MultimodalStep
from pagoda.request import Sequence
from pagoda.step import ModelOutput, SeqStepResult, StepAbandoned
from pagoda.transfer import to_device, zeros

if TYPE_CHECKING:
    from pagoda.executor.kv_offload import KVBlockCodec
    from pagoda.kvcache.tiers.base import KVTransfers
    from pagoda.kvcache.tiers.store import TieredStore
    from pagoda.step import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "make_attention_backend"]


def make_attention_backend(device: str):
    if device.startswith("cuda"):
        from pagoda.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from pagoda.kernels import attention as cpu_kernel
    from pagoda.kernels import fused as cpu_fused
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend

    # Compiled once per machine, at start-up rather than inside the first request. (The gemv,
    # quantized, MoE and fused-decode kernels load while the weights are packed and the KV
    # cache attached, also at start-up.)
    cpu_kernel.load()
    cpu_fused.module()
    return TorchAttentionBackend()


class ModelRunner(StepPhases):
    """The model, its KV cache and its sampler in this process (an ``Executor``; also rank 0
    of a ``TPExecutor`` and the draft model's runner)."""

    # ``execute`` runs a scheduled step's lookahead decode steps (multi-step decoding).
    runs_lookahead = True
    # Asked between a round's steps; True ends the round there (``EngineCore.interrupt_rounds_when``).
    round_interrupt: Callable[[], bool] | None = None
    # Asked between the decoder layers of a step made only of background rows; True gives the
    # step up (``ModelOutput.abandoned``; ``EngineCore.abandon_background_when``).
    abandon_background: Callable[[], bool] | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)
        set_expert_parallel(config.parallel.enable_expert_parallel)
        self._load_model()
        self.lora = self._make_lora_manager()
        self._sleep_blocks = 0  # the KV cache's blocks while asleep (sleep mode)
        self.sampler = Sampler(config.seed)
        self.generators = SeedGenerators()
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # quantized caches: per token and K/V head
        kv_quant.check_device_support(config.cache.kv_cache_dtype, self.device)
        self.decode_graphs: DecodeGraphs | None = None
        # Async scheduling (``engine/async_scheduling.StepPipeline``): steps of one plain token
        # per sequence (greedy or sampled, no logprobs) leave their ids on the device
        # (``ModelOutput.pending``), so the next step is launched before the host reads them.
        self.defer_ids = False
        self.decode_step: Callable[..., torch.Tensor] | None = None  # see _lean_decode_step
        self._decode_embed: torch.Tensor | None = None  # its token embedding table
        # Embedding requests prefilled in chunks: request id -> the float32 sum of its rows so
        # far (MEAN) or its first row (CLS), until its last chunk.
        self._pool_partial: dict[str, torch.Tensor] = {}
        self.kv_offload: "KVBlockCodec | None" = None  # KV tiers' copies (attach_kv_store)
        # Vision-language models: the encoder cache and each step's image rows and positions.
        self.mm = (MultimodalStep(self.model, config.cache.mm_encoder_cache_bytes, self.device)
                   if config.model.is_multimodal else None)

    def _load_model(self) -> None:
        """Load ``config.model``'s weights (and pack them for the CPU kernels)."""
        config, start = self.config, time.perf_counter()
        self.model = load_model(config.model, make_attention_backend(config.device), config.device)
        if self.device.type == "cpu":
            cpu_gemm.pack_model(self.model)
        # Hybrid models: the Mamba layers whose recurrent states live in slots (one per sequence
        # the step may run, so max_num_seqs of them); none for plain decoders.
        self.state_layers: list = getattr(self.model, "state_layers", lambda: [])()
        self.num_state_slots = config.scheduler.max_num_seqs if self.state_layers else 0
        if self.state_layers:
            self.runs_lookahead = False  # a lookahead round builds its own steps, without state slots
        logger.info("loaded %s (%.1fM parameters, %s%s) in %.2fs", config.model.path,
                    config.model.num_params / 1e6, config.model.dtype,
                    f", quantization {self.model.quant_config!r}" if self.model.quant_config else "",
                    time.perf_counter() - start)

    # ---- sleep mode (one process, no LoRA: config._check_sleep_mode) ----------------------
    def sleep(self, level: int) -> int:
        """Release the KV cache (level 1), and the weights too (level 2), back to the system;
        returns the bytes released. No step may run until ``wake_up``."""
        if self.kv_cache is not None:
            self._sleep_blocks = self.num_blocks
        freed = self._drop_kv_cache()
        if level >= 2 and self.model is not None:
            freed += model_bytes(self.model)
            self.model = None  # type: ignore[assignment]
        self._release_memory()
        return freed

    def wake_up(self) -> None:
        """Reload what ``sleep`` released: the weights from ``config.model`` (level 2) and a
        zeroed KV cache of the same size (its contents were dropped: the prefix cache is empty)."""
        if self.model is None:
            self._load_model()
        if self.kv_cache is None and self._sleep_blocks:
            self.allocate_kv_cache(self._sleep_blocks)
            self.capture_cuda_graphs()

    def reload_weights(self, config: EngineConfig) -> None:
        """Serve ``config.model`` (another checkpoint of the same shapes) from now on: the old
        weights and cache go first, so both never occupy memory at once."""
        blocks = self.num_blocks or self._sleep_blocks
        self._drop_kv_cache()
        self.model = None  # type: ignore[assignment]
        self._release_memory()
        self.config = config
        self._load_model()
        self.allocate_kv_cache(blocks)
        self.capture_cuda_graphs()

    def _drop_kv_cache(self) -> int:
        """Forget every reference to the KV cache (the layers', the fused CPU decode blocks',
        the CUDA graphs'); returns its bytes."""
        if self.kv_cache is None:
            return 0
        freed = self.kv_cache.numel() * self.kv_cache.element_size()
        if self.kv_scales is not None:
            freed += self.kv_scales.numel() * self.kv_scales.element_size()
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0, device=self.device)
            if self.kv_scales is not None:
                layer.k_scale = layer.v_scale = None
        for module in self.model.modules():  # cpu_decode.attach's blocks hold the cache tensors
            if getattr(module, "cpu_decode", None) is not None:
                module.cpu_decode = None
            if getattr(module, "cpu_decode_stack", None) is not None:
                module.cpu_decode_stack = None
        for layer in self.state_layers:  # recurrent states go with the blocks (nothing runs until both return)
            freed += layer.conv_state.numel() * layer.conv_state.element_size() + layer.ssm_state.numel() * 4
            layer.conv_state = layer.ssm_state = torch.empty(0, device=self.device)
        self.kv_cache = self.kv_scales = None
        self.decode_step = self.decode_graphs = None
        self._decode_embed = None
        return freed

    def _release_memory(self) -> None:
        """Hand freed memory back to the system: CUDA's cached blocks, and on the host the
        heap's free pages (weights of a few MiB each come from malloc's arenas, which keep
        them after ``free`` unless trimmed)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: what free() kept stays with the process
            pass

    def _make_lora_manager(self):
        """LoRA wrappers around the target layers (after packing: they call the base layer)."""
        if self.config.lora is None:
            return None
        from pagoda.lora.manager import LoRAManager

        return LoRAManager(self.model, self.config, self.device)

    def add_lora(self, request) -> None:
        """Load and check an adapter into the host cache; ``ValueError`` if it cannot be served."""
        if self.lora is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora (--enable-lora)")
        self.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    # ---- KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        planes, heads, dim = self._kv_layout()
        per_head = kv_quant.bytes_per_token_head(self.config.cache.kv_cache_dtype, dim)
        return planes * len(layers) * self.block_size * heads * per_head

    def _kv_layout(self) -> tuple[int, int, int]:
        """Per layer and token: cache planes (2: K and V; 1: MLA's latent serves as both),
        heads and width, as the attention layers declare them."""
        layer = self.model.attention_layers()[0]
        return (getattr(layer, "kv_planes", 2), layer.num_kv_heads,
                getattr(layer, "kv_head_dim", self.config.model.head_dim))

    def determine_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            # The profile's peak holds the recurrent-state pool already (allocated for its step).
            return int(self._profile_gpu_budget() // self.kv_bytes_per_block())
        if budget is None:
            budget = CPU_DEFAULT_KV_CACHE_MEMORY
        # The recurrent-state pool comes out of the same budget as the blocks.
        states = self.state_bytes()
        if states and states >= budget:
            raise ValueError(f"the recurrent-state pool of {self.num_state_slots} sequences (max_num_seqs) takes "
                             f"{states / 2**20:.1f} MiB, more than the KV cache memory of {budget / 2**20:.1f} MiB: "
                             "lower max_num_seqs or give the cache more memory (kv_cache_memory)")
        return int((budget - states) // self.kv_bytes_per_block())

    def state_bytes(self) -> int:
        """Bytes of the recurrent-state pool (hybrid models; 0 otherwise)."""
        total = 0
        for layer in self.state_layers:
            conv, ssm = layer.state_shapes(self.num_state_slots)
            total += math.prod(conv) * self.config.model.dtype.itemsize + math.prod(ssm) * 4
        return total

    def _allocate_states(self) -> None:
        """Each Mamba layer's conv (model dtype) and SSM (float32) states, one row per slot."""
        for layer in self.state_layers:
            conv, ssm = layer.state_shapes(self.num_state_slots)
            if tuple(layer.conv_state.shape) != conv:
                layer.conv_state = torch.zeros(conv, dtype=self.config.model.dtype, device=self.device)
                layer.ssm_state = torch.zeros(ssm, dtype=torch.float32, device=self.device)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent states between slots (a prompt forked into its samples)."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.state_layers:
            layer.conv_state[dst] = layer.conv_state[src]
            layer.ssm_state[dst] = layer.ssm_state[src]

    def _profile_gpu_budget(self) -> int:
        from pagoda.executor.gpu_profile import profile_kv_budget

        return profile_kv_budget(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        planes, heads, dim = self._kv_layout()
        shape = (len(layers), planes, num_blocks, self.block_size, heads, dim)
        # Zeroed once: slots past a sequence's end are masked, but a masked NaN still poisons
        # attention (0 * NaN), so stale slots must only ever hold finite values. (On the host the
        # OS zeroes each page when first touched: ``transfer.zeros``.)
        self.kv_cache = zeros(shape, self.config.cache.kv_cache_dtype, self.device)
        self.kv_scales = kv_quant.allocate_scales(shape, self.config.cache.kv_cache_dtype, self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, planes - 1]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[i, 0], self.kv_scales[i, planes - 1]
        self._allocate_states()
        if self.device.type == "cpu":
            cpu_decode.attach(self.model)  # its blocks hold the layers' cache tensors
        self.decode_step = self._lean_decode_step()

    def _lean_decode_step(self) -> Callable[..., torch.Tensor] | None:
        """The logits of a batch of one-token decodes on CPU as the model computes them, with
        none of the per-step module plumbing around its three calls (token lookup, the fused
        layer stack with the final norm, the LM head): each of the dozen cold Python and torch
        calls it spares costs microseconds after a step has streamed the weights, a tenth of a
        1 ms step in all. For the multi-step greedy loop (``cpu_fused.greedy_steps``); None
        where the model is not the plain decoder with a fused stack (then ``step_logits`` runs). A
        vision-language model whose text steps are its decoder's (``text_decode_is_plain``) takes
        it too: its image requests never look ahead (the scheduler keeps them to single steps)."""
        from pagoda.models.decoder import DecoderForCausalLM, DecoderModel

        model = self.model
        inner = getattr(model, "model", None)
        stack = getattr(inner, "cpu_decode_stack", None)
        plain = type(model) is DecoderForCausalLM or getattr(model, "text_decode_is_plain", False)
        if (self.device.type != "cpu" or self.lora is not None or not plain or type(inner) is not DecoderModel
                or inner.embed_scale is not None or stack is None or not stack.final_norm
                or not (inner.is_first and inner.is_last) or model.lm_head.tp_size != 1
                or inner.embed_tokens.tp_size != 1):
            return None
        embed, head = inner.embed_tokens.weight, model.lm_head
        self._decode_embed = embed

        def step(inputs: ModelInput, x: torch.Tensor | None = None) -> torch.Tensor:
            """``x``: the input tokens' embedding rows when the caller has them already."""
            if x is None:
                x = torch.embedding(embed, inputs.input_ids)
            hidden, _ = stack(inputs.positions, x, None, inputs.meta)
            return head.compute_logits(hidden)

        return step

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache.shape[2]) if self.kv_cache is not None else 0

    def capture_cuda_graphs(self) -> None:
        """Capture decode CUDA graphs (CUDA only, unless ``enforce_eager``); call once, after
        the final ``allocate_kv_cache``."""
        self.decode_graphs = capture_decode_graphs(self)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies and self.kv_cache is not None:
            src = to_device(torch.tensor([s for s, _ in copies]), self.device)
            dst = to_device(torch.tensor([d for _, d in copies]), self.device)
            cache = kv_quant.byte_view(self.kv_cache)
            cache[:, :, dst] = cache[:, :, src]
            if self.kv_scales is not None:  # a quantized block is its values and their scales
                self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def attach_kv_store(self, store: "TieredStore") -> None:
        """Serve the KV tiers' copies (``transfer_kv``) between this cache and ``store``."""
        from pagoda.executor.kv_offload import KVBlockCodec

        assert self.kv_cache is not None, "allocate the KV cache first"
        self.kv_offload = KVBlockCodec(self.kv_cache, self.kv_scales, store)

    def transfer_kv(self, transfers: "KVTransfers") -> None:
        """Do KV-tier copies (``KVTransfers``): snapshots of blocks going out, then loads."""
        assert self.kv_offload is not None, "no KV tiers attached"
        if self.kv_offload.kv_cache is not self.kv_cache:  # reallocated (a wake-up): copy to the new one
            self.attach_kv_store(self.kv_offload.store)
        self.kv_offload.transfer(transfers)

    def shutdown(self) -> None:
        """Release the KV cache, the CUDA graphs, the adapters and the weights, and hand the
        memory back: a shut-down engine leaves the device as it found it even while objects
        that referred to it live on, so the next engine in the process can size its cache at
        once. Idempotent; no step may run after it."""
        if self.model is not None:
            self._drop_kv_cache()
        self.model = None  # type: ignore[assignment]
        self.mm = self.lora = self.kv_offload = None
        self._pool_partial.clear()
        self._release_memory()

    # ---- one step ------------------------------------------------------------------------
    def begin_step(self, sched: SchedulerOutput) -> None:
        """What a step does before its forward pass: drop the state of requests that left,
        KV-tier copies, block copies (copy on write)."""
        if sched.finished_request_ids:
            self.generators.drop(sched.finished_request_ids)
            for request_id in sched.finished_request_ids:
                self._pool_partial.pop(request_id, None)
            if self.mm is not None:
                self.mm.drop(sched.finished_request_ids)
        if sched.kv_transfers:
            self.transfer_kv(sched.kv_transfers)
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        if sched.state_copies:
            self.copy_states(sched.state_copies)

    def run_step(self, sched: SchedulerOutput, inputs: ModelInput, plan: LogitsPlan) -> ModelOutput:
        """The forward pass and sampling of a non-empty step whose inputs ``prepare`` built
        (after ``begin_step``). A step of background rows only, with ``abandon_background``
        set, is given up as soon as that says so between layers (or before the first): it
        returns ``ModelOutput(abandoned=True)`` having sampled nothing; in a multi-step round
        the steps finished before it are kept (the round ends there)."""
        abandon = self.abandon_background
        if abandon is None or not all(item.seq.request.background for item in sched.scheduled):
            return self._run_step(sched, inputs, plan)
        inputs.meta.abandon = abandon
        try:
            if abandon():
                raise StepAbandoned()
            return self._run_step(sched, inputs, plan)
        except StepAbandoned:
            return ModelOutput(abandoned=True)

    def _run_step(self, sched: SchedulerOutput, inputs: ModelInput, plan: LogitsPlan) -> ModelOutput:
        if plan.pooled:  # (no lookahead then: an embedding prefill is no decode)
            return self._pooling_step(inputs, plan)
        lookahead = sched.scheduled[0].num_lookahead
        greedy = lookahead and all(item.seq.params.greedy for item in sched.scheduled)
        graphs = self.decode_graphs
        if greedy and graphs is not None and graphs.serves_round(inputs):
            # Multi-step greedy decoding through the decode graphs: each step's argmax feeds
            # the next on the device, and the host reads the round's ids once, at its end.
            ends = [_ending_tokens(item.seq) for item in sched.scheduled]
            abandon, interrupt = inputs.meta.abandon, self.round_interrupt
            rows = graphs.greedy_round(inputs, 1 + lookahead, ends,
                                       lambda: (interrupt is not None and interrupt())
                                       or (abandon is not None and abandon()))
            return ModelOutput({item.seq.seq_id: SeqStepResult(t) for item, t in zip(sched.scheduled, rows)})
        if greedy and cpu_fused.serves_steps(inputs):
            # Multi-step greedy decoding on CPU: the whole round in one loop (the scheduler let
            # only plain sequences look ahead, so each token is its row's argmax), every step on
            # the lean decode step where the model has one.
            lean = self.decode_step
            step = lean if lean is not None and self.decode_stack_serves() else self.step_logits
            ends = [_ending_tokens(item.seq) for item in sched.scheduled]
            rnd = cpu_fused.greedy_round(inputs, self.block_size, lookahead, ends,
                                         self._decode_embed if step is lean else None)
            # (No inference_mode around it: every weight is frozen, no input asks for gradients,
            # and entering it is tens of microseconds cold.)
            logits = step(inputs) if step is not lean else step(inputs, rnd.embed_inputs())
            if cpu_fused.serves_greedy(logits):
                tokens = cpu_fused.greedy_steps(rnd, logits, inputs, lookahead, step, self.round_interrupt,
                                                host_meta=step is not lean)
                return ModelOutput({item.seq.seq_id: SeqStepResult(t) for item, t in zip(sched.scheduled, tokens)})
        else:
            logits = self.step_logits(inputs)
        out = self.sample(plan, logits)
        return self._look_ahead(sched, plan, out, lookahead, inputs.meta.abandon) if lookahead else out

    def _pooling_step(self, inputs: ModelInput, plan: LogitsPlan) -> ModelOutput:
        """A step with embedding requests in it: the others sample as in any step; each
        embedding request's chunk is pooled from the hidden states (which the final norm has
        run on), and its last chunk's result carries the pooled vector and no token."""
        hidden = self.forward(inputs)
        out = self.sample(plan, self.model.compute_logits(hidden[inputs.logits_indices])) if plan.entries \
            else ModelOutput()
        for item, first in plan.pooled:
            try:
                vector = self._pool(item, hidden[first:first + item.num_new_tokens])
            except Exception as exc:
                self._pool_partial.pop(item.seq.request_id, None)
                self._fail(out, item.seq, exc)
                continue
            if vector is not None:
                out.results[item.seq.seq_id] = SeqStepResult([], embedding=vector)
        return out

    def _pool(self, item: "ScheduledSeq", rows: torch.Tensor) -> list[float] | None:
        """Fold one chunk's hidden ``rows`` into its request's pooling; the pooled float32
        vector at the prompt's last chunk, else None. A chunk that starts at position 0 starts
        afresh (a preempted request is recomputed from its first token)."""
        seq, key = item.seq, item.seq.request_id
        kind, last = seq.params.pooling, item.end >= seq.num_tokens
        if kind == "LAST":
            return rows[-1].float().tolist() if last else None
        if kind == "CLS":
            if item.start == 0:
                self._pool_partial[key] = rows[0].float()
        else:  # MEAN
            part = rows.float().sum(0)
            self._pool_partial[key] = part if item.start == 0 else self._pool_partial[key] + part
        if not last:
            return None
        pooled = self._pool_partial.pop(key)
        return (pooled / seq.num_tokens if kind == "MEAN" else pooled).tolist()

    def decode_stack_serves(self) -> bool:
        """Whether the fused layer stack still stands for every layer (see
        ``FusedDecodeStack.serves``), checked once per round rather than once per step."""
        stack = self.model.model.cpu_decode_stack
        return stack is not None and stack.serves()

    def step_logits(self, inputs: ModelInput) -> torch.Tensor:
        """The logits of the step's logits rows: from a decode graph (which holds the LM head
        on one rank) where one serves the step, else ``forward`` then the LM head. Every rank of
        a tensor-parallel group takes the same way (each decides alike from the same inputs), so
        the head's gather meets on all of them."""
        graphs = self.decode_graphs
        if graphs is not None and inputs.positions.dim() == 1 and graphs.can_run(inputs):  # not M-RoPE [3, T]
            logits = graphs.run_logits(inputs)
            return logits if inputs.logits_all_rows else logits[inputs.logits_indices]
        hidden = self.forward(inputs)
        return self.model.compute_logits(hidden if inputs.logits_all_rows else hidden[inputs.logits_indices])

    def _look_ahead(self, sched: SchedulerOutput, plan: LogitsPlan, out: ModelOutput, steps: int,
                    abandon: Callable[[], bool] | None = None) -> ModelOutput:
        """Multi-step decoding: ``steps`` more decode steps of the batch of one-token decodes
        (the scheduler gave every item the same lookahead, and blocks for it), each fed the tokens
        the previous one sampled and sampled as in any step (every step's logits row ``i`` is
        sequence ``i``'s, so the first step's plan serves them all; the round's earlier tokens
        count as output). The round ends early once every sequence has sampled a token that ends
        it, when ``round_interrupt`` says so (work arrived), at a step ``abandon`` gives up (see
        ``run_step``), or at a step where a sequence's
        sampling failed: everyone keeps the tokens sampled so
        far (the others' of that step too, so seeded draws are not lost), and the failing
        sequence samples again in the next round's first step, which reports it as any step
        does if it fails again."""
        items = sched.scheduled
        if out.failed or any(out.results.get(item.seq.seq_id) is None for item in items):
            return out  # the first step's failures are reported as in any step
        n = len(items)
        rows = list(range(n))
        kept = {item.seq.seq_id: out.results[item.seq.seq_id].token_ids for item in items}
        ends = [_ending_tokens(item.seq) for item in items]
        tables = [item.seq.block_table for item in items]
        seq_lens = [item.end for item in items]
        interrupt = self.round_interrupt
        for _ in range(steps):
            tokens = [kept[item.seq.seq_id][-1] for item in items]
            if all(t in e for t, e in zip(tokens, ends)) or (interrupt is not None and interrupt()):
                break
            seq_lens = [x + 1 for x in seq_lens]
            inputs = build_model_input(tokens, [1] * n, seq_lens, tables, rows, self.device, self.block_size)
            inputs.meta.abandon = abandon
            try:
                step = self.sample(plan, self.step_logits(inputs), kept)
            except StepAbandoned:
                break  # interactive work arrived: the round keeps the steps it finished
            for seq_id, result in step.results.items():
                kept[seq_id].extend(result.token_ids)
            if step.failed or len(step.results) != n:
                logger.debug("multi-step round ends early: %s", step.failed)
                break
        return out

    @torch.inference_mode()
    def forward(self, inputs: ModelInput, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Hidden states of the step; under pipeline parallelism this stage's part
        (``intermediate``: the previous stage's hidden states and residual, see ``DecoderModel``)."""
        lora = self.lora.batch(inputs.lora_slots) if self.lora is not None else contextlib.nullcontext()
        with forward_context(inputs.meta), lora:
            if inputs.mm is not None:
                return self.model(inputs.input_ids, inputs.positions, intermediate, mm=inputs.mm)
            return self.model(inputs.input_ids, inputs.positions, intermediate)

    def prepare(self, sched: SchedulerOutput, device: torch.device | None = None) -> tuple[ModelInput, LogitsPlan]:
        """The step's tensors and logits plan, on ``device`` (default: the runner's)."""
        slots = self.lora.seq_slots(sched) if self.lora is not None else None
        inputs, plan = prepare_model_input(sched, device or self.device, self.block_size, slots)
        if self.mm is not None:
            self.mm.prepare(sched, inputs)
        return inputs, plan

    # ---- sampling ------------------------------------------------------------------------
    def sample(self, plan: LogitsPlan, logits: torch.Tensor, produced: dict[str, list[int]] | None = None
               ) -> ModelOutput:
        """Prompt logprobs, sampling and draft verification for every planned sequence.

        A sequence whose own part of this raises (hostile sampling values, a bug that one
        request's options trigger) is reported in ``ModelOutput.failed`` and gets no result;
        every other sequence gets exactly the result it would have had without it."""
        produced = produced or {}
        quick = self._sample_plain(plan, logits, produced)
        if quick is not None:
            return quick
        out = ModelOutput()
        batch = _SampleBatch()
        spec: list[PlanEntry] = []
        for entry in plan.entries:
            try:
                self._plan_entry(entry, logits, out, batch, spec, produced)
            except Exception as exc:
                self._fail(out, entry.item.seq, exc)
        if batch.rows:
            self._sample_batch(batch, logits, out)
        if spec:
            self._verify_drafts(spec, logits, out)
        return out

    def _sample_plain(self, plan: LogitsPlan, logits: torch.Tensor, produced: dict[str, list[int]]
                       ) -> ModelOutput | None:
        """The common decode step in one call: every entry samples one token of one
        unconstrained, non-speculating sequence with no logprobs of any kind, greedy (or, where
        the step's ids stay on the device, ``defer_ids``, sampled too). None where any entry is
        otherwise, or where the call raises: the general path then runs (and isolates the failing
        row) from the generators' state before the call. When every row is plain greedy
        (``plain_greedy_params``) no sampler rows are built: each token is its row's argmax,
        as ``Sampler.sample_from`` would take it from those rows (a greedy row never draws, so
        not creating a seeded request's generator here changes none of its draws)."""
        entries = plan.entries
        all_plain = True
        for e in entries:
            item = e.item
            seq = item.seq
            params = seq.params
            if (e.sample_row is None or e.prompt_rows or e.num_samples != 1 or item.num_draft_tokens
                    or item.bitmask is not None or (not params.greedy and not self.defer_ids)
                    or params.logprobs is not None):
                return None
            if all_plain:
                drafted = produced.get(seq.seq_id, ())
                all_plain = plain_greedy_params(params, len(seq.token_ids) - seq.num_prompt_tokens + len(drafted))
        row_index = [e.sample_row for e in entries]
        snapshot = None
        try:
            if self.defer_ids:
                seq_ids = [e.item.seq.seq_id for e in entries]
                if all_plain:
                    return ModelOutput(pending=DeviceTokens(Sampler.greedy_on_device(logits, row_index), seq_ids))
                rows = self._plain_rows(entries, produced)
                snapshot = RngSnapshot([r.generator for r in rows] + [self.sampler.generator])
                return ModelOutput(pending=DeviceTokens(self.sampler.tokens(select_rows(logits, row_index), rows),
                                                        seq_ids))
            if all_plain:
                tokens = Sampler.greedy(logits, row_index)
            else:
                tokens = self.sampler.sample_from(logits, row_index, self._plain_rows(entries, produced)).token_ids
        except Exception:
            if snapshot is not None:
                snapshot.restore()  # the general path draws again from where this one began
            return None
        return ModelOutput({e.item.seq.seq_id: SeqStepResult([t]) for e, t in zip(entries, tokens)})

    def _plain_rows(self, entries: list[PlanEntry], produced: dict[str, list[int]]) -> list[SampleRow]:
        return [sample_row(e.item.seq, self.generators, drafts=produced.get(e.item.seq.seq_id, ())) for e in entries]

    def _plan_entry(self, entry: PlanEntry, logits: torch.Tensor, out: ModelOutput, batch: "_SampleBatch",
                    spec: list[PlanEntry], produced: dict[str, list[int]]) -> None:
        """Prompt logprobs now; the entry's sampling rows into ``batch`` (or ``spec``)."""
        seq = entry.item.seq
        if entry.prompt_rows:
            k = seq.params.prompt_logprobs or 0
            lps, ranks = prompt_logprobs(logits[entry.prompt_rows], entry.prompt_next_tokens, k)
            result = out.results.setdefault(seq.seq_id, SeqStepResult([]))
            first: list = [None] if not seq.request.prompt_logprobs else []
            result.prompt_logprobs, result.prompt_ranks = first + lps, first + ranks
        if entry.sample_row is None:
            return
        if entry.item.num_draft_tokens:
            spec.append(entry)
            return
        indices = [seq.sample_index] if entry.num_samples == 1 else list(range(entry.num_samples))
        rows = [sample_row(seq, self.generators, i, produced.get(seq.seq_id, ())) for i in indices]
        if entry.item.bitmask is not None:  # a grammar constrains this sequence: its mask, or a
            for row in rows:                # deferred one (structured_output.manager)
                entry.item.bitmask.attach(row)
        batch.add(seq, entry.sample_row, rows)

    def _sample_batch(self, batch: "_SampleBatch", logits: torch.Tensor, out: ModelOutput) -> None:
        def call(idx: list[int]) -> SamplerOutput:
            return self.sampler.sample_from(logits, [batch.row_of[i] for i in idx], [batch.rows[i] for i in idx])

        # Rewinding is for rows that draw; greedy rows without a deferred grammar draw nothing,
        # and not snapshotting the generators spares a step tens of microseconds.
        draws = any(not r.params.greedy or r.grammar is not None for r in batch.rows)
        generators = [r.generator for r in batch.rows] + [self.sampler.generator] if draws else []
        sampled = run_rows(call, len(batch.rows), generators, "sampling")
        for i, error in sampled.failed.items():
            self._fail(out, batch.owners[i], error)
        for idx, chunk in sampled.chunks:
            for j, i in enumerate(idx):
                seq, row = batch.owners[i], batch.rows[i]
                if seq.seq_id in out.failed:
                    continue  # another of its samples failed: the request ends
                result = out.results.setdefault(seq.seq_id, SeqStepResult([]))
                result.token_ids.append(chunk.token_ids[j])
                if chunk.token_logprobs is not None and row.params.logprobs is not None:
                    result.token_logprobs = (result.token_logprobs or []) + [chunk.token_logprobs[j]]
                    result.logprobs = (result.logprobs or []) + [chunk.logprobs[j]]

    def _verify_drafts(self, entries: list[PlanEntry], logits: torch.Tensor, out: ModelOutput) -> None:
        """Speculating sequences: accept a prefix of their drafts, then one target token."""
        kept, drafts, row_sets = [], [], []
        for entry in entries:
            seq, draft, first = entry.item.seq, entry.item.draft, entry.sample_row
            assert draft is not None and first is not None  # only sampling, speculating entries come here
            try:
                masks = entry.item.bitmask.rows() if entry.item.bitmask is not None else None
                drafts.append(DraftRow(sample_row(seq, self.generators), draft.token_ids, draft.probs, masks))
            except Exception as exc:
                self._fail(out, seq, exc)
                continue
            kept.append(entry)
            row_sets.append(list(range(first, first + draft.k + 1)))
        default = self.sampler.default_generator(logits.device)

        def call(idx: list[int]) -> list[Verdict]:
            return verify(logits[[r for i in idx for r in row_sets[i]]], [drafts[i] for i in idx], default)

        verdicts = run_rows(call, len(drafts), [d.row.generator for d in drafts] + [default], "draft verification")
        for i, error in verdicts.failed.items():
            self._fail(out, kept[i].item.seq, error)
        for idx, chunk in verdicts.chunks:
            for i, verdict in zip(idx, chunk):
                try:
                    self._emit_verdict(kept[i].item.seq, drafts[i], verdict, logits[row_sets[i]], out)
                except Exception as exc:
                    self._fail(out, kept[i].item.seq, exc)

    def _emit_verdict(self, seq: Sequence, draft: DraftRow, verdict: Verdict, rows: torch.Tensor,
                      out: ModelOutput) -> None:
        """The accepted drafts and the target's token, with their logprobs when asked."""
        result = SeqStepResult(verdict.token_ids, num_draft_accepted=verdict.num_accepted)
        if draft.row.params.logprobs is not None:
            emitted = rows[:len(verdict.token_ids)].float().log_softmax(-1)
            lp = self.sampler.gather_logprobs(emitted, verdict.token_ids, [draft.row] * len(verdict.token_ids))
            result.token_logprobs, result.logprobs = lp.token_logprobs, lp.logprobs
        out.results[seq.seq_id] = result

    @staticmethod
    def _fail(out: ModelOutput, seq: Sequence, exc: Exception) -> None:
        """End ``seq``'s request for this step's failure; the traceback goes to the log."""
        logger.error("request %s failed while sampling; ending it alone", seq.request_id, exc_info=exc)
        out.failed[seq.seq_id] = describe(exc)
        out.results.pop(seq.seq_id, None)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensor storages ``model``'s modules hold: parameters, buffers and
    the plain tensor attributes packed copies of weights live in (CPU kernels; an opaque packed
    tensor counts its elements)."""
    storages: dict[int, int] = {}
    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor) and value.numel():
                try:
                    storage = value.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except (NotImplementedError, RuntimeError):  # an opaque (e.g. oneDNN-packed) tensor
                    storages[id(value)] = value.numel() * value.element_size()
    return sum(storages.values())


def _ending_tokens(seq: Sequence) -> frozenset[int]:
    """The tokens that would end ``seq`` if sampled now (its min_tokens already reached)."""
    ids = set(seq.params.stop_token_ids or ())
    if not seq.params.ignore_eos:
        ids.update(seq.request.eos_token_ids)
    return frozenset(ids)


class _SampleBatch:
    """The ordinary (non-speculating) sampling rows of a step: a sequence with ``n > 1`` samples
    at its prompt's end owns ``n`` consecutive rows."""

    def __init__(self) -> None:
        self.rows: list[SampleRow] = []
        self.row_of: list[int] = []  # the logits row of each
        self.owners: list[Sequence] = []

    def add(self, seq: Sequence, logits_row: int, rows: list[SampleRow]) -> None:
        self.rows.extend(rows)
        self.row_of.extend([logits_row] * len(rows))
        self.owners.extend([seq] * len(rows))
