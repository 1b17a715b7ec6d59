"""``LoRAManager``: adapters of one model runner (one rank).

Three tiers: the adapter directory on disk; a host cache of loaded, checked adapters (at most
``max_cpu_loras``, least recently used dropped first); ``max_loras`` fixed slots in the
wrappers' stacked tensors (on the model's device). Each step ``activate`` makes that step's
adapters resident (the scheduler never puts more than ``max_loras`` distinct adapters in a
step), evicting the least recently used slot that the step does not need, and the model runner
turns each row's adapter into its slot index. Under tensor parallelism rank 0 decides and
``take_placements`` lists the slot writes the other ranks must repeat (``place``).
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator

import torch

from pagoda.lora.layers import LoRABatch, LoRALinear, LoRAState
from pagoda.lora.peft import AdapterConfig, load_adapter_weights, read_adapter_config
from pagoda.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagoda.config import EngineConfig, ModelConfig
    from pagoda.step import SchedulerOutput

logger = logging.getLogger(__name__)

# pagoda module -> the PEFT targets it fuses, in output order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_ROW_PARALLEL = {"o_proj", "down_proj"}
_MODULE_OF = {target: module for module, targets in _FUSED.items() for target in targets}


class LoadedAdapter:
    """An adapter in the host cache: its checked config and full-size tensors."""

    def __init__(self, request: LoRARequest, config: AdapterConfig,
                 weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.request = request
        self.config = config
        self.weights = weights


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: "EngineConfig", device: torch.device) -> None:
        assert config.lora is not None
        self.model_config = config.model
        self.max_loras = config.lora.max_loras
        self.max_rank = config.lora.max_lora_rank
        self.max_cpu_loras = config.lora.max_cpu_loras
        self.device = device
        self.state = LoRAState()
        self.wrappers: dict[tuple[int, str], LoRALinear] = {}
        self._wrap(model)
        self.cache: OrderedDict[int, LoadedAdapter] = OrderedDict()  # host cache, LRU first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident adapter id -> slot, LRU first
        self.slots: list[int | None] = [None] * self.max_loras
        self._placements: list[tuple[int, LoRARequest]] = []

    def _wrap(self, model: torch.nn.Module) -> None:
        """Wrap each decoder layer's dense projections. Layers built otherwise (MoE experts, MLA
        attention) get no wrapper, and adapters that target them are refused in ``add``."""
        from pagoda.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)

        kinds = {"qkv_proj": QKVParallelLinear, "o_proj": RowParallelLinear,
                 "gate_up_proj": MergedColumnParallelLinear, "down_proj": RowParallelLinear}
        m = self.model_config
        for i, layer in enumerate(model.model.layers):
            for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                base = getattr(parent, name, None)
                if not isinstance(base, kinds[name]):
                    continue
                subs, fan_in = _layout(base, name, m)
                wrapper = LoRALinear(base, subs, fan_in, self.max_loras, self.max_rank, name in _ROW_PARALLEL,
                                     self.state, m.dtype, self.device)
                setattr(parent, name, wrapper)
                self.wrappers[(i, name)] = wrapper

    # ---- the host cache ----------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoadedAdapter:
        """Load and check ``request``'s adapter into the host cache (``ValueError`` if it
        cannot be served); already cached: just mark it used."""
        loaded = self.cache.get(request.lora_int_id)
        if loaded is not None and loaded.request == request:
            self.cache.move_to_end(request.lora_int_id)
            return loaded
        cfg = read_adapter_config(request.lora_path, self.max_rank)
        weights = load_adapter_weights(cfg, self.model_config)
        for layer, target in weights:
            if (layer, _MODULE_OF[target]) not in self.wrappers:
                raise ValueError(f"LoRA adapter {request.lora_path!r}: layer {layer} of this model has no dense "
                                 f"{target} to apply it to (mixture-of-experts and MLA layers take no LoRA)")
        loaded = LoadedAdapter(request, cfg, weights)
        self.cache[request.lora_int_id] = loaded
        while len(self.cache) > self.max_cpu_loras:
            dropped, _ = self.cache.popitem(last=False)
            logger.debug("LoRA adapter %d left the host cache", dropped)
        return loaded

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter: host cache and slot (the slot's rows are cleared when reused)."""
        self.cache.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None

    # ---- slots -------------------------------------------------------------------------------
    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Make every adapter of ``requests`` (distinct, at most ``max_loras``) resident; returns
        adapter id -> slot."""
        if len(requests) > self.max_loras:
            raise RuntimeError(f"{len(requests)} adapters in one step exceed max_loras {self.max_loras}")
        needed = {r.lora_int_id for r in requests}
        for request in requests:
            slot = self.slot_of.get(request.lora_int_id)
            if slot is not None and self._resident(slot, request):
                self.slot_of.move_to_end(request.lora_int_id)
                continue
            slot = self._free_slot(needed)
            self.place(slot, request)
            self._placements.append((slot, request))
        return {r.lora_int_id: self.slot_of[r.lora_int_id] for r in requests}

    def _resident(self, slot: int, request: LoRARequest) -> bool:
        cached = self.cache.get(request.lora_int_id)
        return self.slots[slot] == request.lora_int_id and (cached is None or cached.request == request)

    def _free_slot(self, needed: set[int]) -> int:
        for slot, owner in enumerate(self.slots):
            if owner is None:
                return slot
        for lora_id, slot in self.slot_of.items():  # least recently used first
            if lora_id not in needed:
                del self.slot_of[lora_id]
                self.slots[slot] = None
                return slot
        raise RuntimeError("no LoRA slot is free")  # unreachable: callers pass <= max_loras adapters

    def place(self, slot: int, request: LoRARequest) -> None:
        """Write ``request``'s adapter into ``slot`` (loading it into the host cache first if needed)."""
        loaded = self.add(request)
        old = self.slots[slot]
        if old is not None:
            self.slot_of.pop(old, None)
        for (layer, name), wrapper in self.wrappers.items():
            wrapper.clear_slot(slot)
            for j, target in enumerate(_FUSED[name]):
                pair = loaded.weights.get((layer, target))
                if pair is not None:
                    a, b = _shard(wrapper, name, j, *pair)
                    wrapper.set_sub(slot, j, a.to(self.device), b.to(self.device))
        self.slots[slot] = request.lora_int_id
        self.slot_of[request.lora_int_id] = slot
        self.slot_of.move_to_end(request.lora_int_id)

    def take_placements(self) -> list[tuple[int, LoRARequest]]:
        """Slot writes since the last call (for the other tensor-parallel ranks to repeat)."""
        placements, self._placements = self._placements, []
        return placements

    # ---- steps -------------------------------------------------------------------------------
    def seq_slots(self, sched: "SchedulerOutput") -> list[int] | None:
        """Each scheduled sequence's slot (-1: the base model); None when no row has an adapter."""
        requests = [item.seq.request.lora_request for item in sched.scheduled]
        distinct = list(dict.fromkeys(r for r in requests if r is not None))
        if not distinct:
            return None
        slot = self.activate(distinct)
        return [slot[r.lora_int_id] if r is not None else -1 for r in requests]

    def batch(self, lora_slots: torch.Tensor | None) -> contextlib.AbstractContextManager[None]:
        """The wrappers see this step's rows while the forward pass runs."""
        return self._serving(LoRABatch(lora_slots, self.device, self.model_config.dtype) if lora_slots is not None
                             else None)

    def dense_batch(self, one_hot: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        """The wrappers take the dense way over ``one_hot`` ``[rows, max_loras]`` (a decode
        graph's static buffer, filled from ``LoRABatch.one_hot_rows`` before each replay)."""
        return self._serving(LoRABatch.dense(one_hot))

    @contextlib.contextmanager
    def _serving(self, batch: LoRABatch | None) -> Iterator[None]:
        self.state.batch = batch
        try:
            yield
        finally:
            self.state.batch = None


def _layout(base: torch.nn.Module, name: str, m: "ModelConfig") -> tuple[list[tuple[str, int, int]], int]:
    """(PEFT target, output offset, output size) of each sub-projection on this rank, and the
    layer's input width on this rank. From the config: a packed or quantized layer may hold
    no dense weight to read shapes from."""
    tp = getattr(base, "tp_size", 1)
    h, q_full = m.hidden_size, m.num_heads * m.head_dim
    if name == "qkv_proj":
        q, kv = base.q_size, base.kv_size
        return [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)], h
    if name == "gate_up_proj":
        half = m.intermediate_size // tp
        return [("gate_proj", 0, half), ("up_proj", half, half)], h
    if name == "o_proj":
        return [("o_proj", 0, h)], q_full // tp
    return [("down_proj", 0, h)], m.intermediate_size // tp


def _shard(wrapper: LoRALinear, name: str, sub: int, a: torch.Tensor,
           b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a full-size (A, B): B's output rows of a column-parallel layer (the
    same rows its base weight holds), A's input columns of a row-parallel one."""
    base = wrapper.base
    size = getattr(base, "tp_size", 1)
    if size == 1:
        return a, b
    rank = base.tp_rank
    if name in _ROW_PARALLEL:
        cols = wrapper.in_features
        return a[:, rank * cols:(rank + 1) * cols], b
    _, _, rows = wrapper.subs[sub]
    if name == "qkv_proj" and sub > 0:
        rank //= base.kv_replicas  # K/V heads replicated over several ranks
    return a, b[rank * rows:(rank + 1) * rows]
