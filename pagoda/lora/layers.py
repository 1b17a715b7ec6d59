"""The batched LoRA delta: ``LoRALinear`` wraps a target linear layer, ``LoRABatch`` groups a
step's token rows by adapter slot once per step.

Every wrapper keeps the adapters of all resident slots stacked: ``a`` is
``[max_loras, in, n_sub * max_rank]`` and ``b`` is ``[max_loras, n_sub * max_rank, out]``,
where a fused layer (qkv, gate/up) has one rank-``max_rank`` block per sub-projection and ``b``
is block-diagonal: sub-projection ``j``'s B sits in rows ``j*R:(j+1)*R`` and the columns of its
own output slice, so one matmul pair gives every slice its own delta. Scaling is folded into
``b``; ranks below ``max_rank`` are zero-padded.

The delta of a step is computed segment-wise (Punica's SGMV idea, with torch ops): rows are
sorted by slot and laid out as ``[active slots, longest segment]``, then one ``bmm`` shrinks
(``x @ A``) and one expands (``@ B``) for all adapters at once, and ``index_add_`` puts the rows
back. Rows without an adapter (slot -1) are not touched; a step with one adapter on every row
takes two plain matmuls. There is no loop over requests or adapters.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.distributed.parallel_state import all_reduce


class LoRABatch:
    """One step's rows grouped by slot; built on the host from the per-row slot indices."""

    def __init__(self, slots: torch.Tensor, device: torch.device) -> None:
        slots = slots.to("cpu", torch.int64)
        rows = torch.nonzero(slots >= 0).flatten()
        by_slot = rows[torch.argsort(slots[rows], stable=True)]
        uniq, counts = torch.unique_consecutive(slots[by_slot], return_counts=True)
        self.active_slots: list[int] = uniq.tolist()
        # The whole batch on one adapter: plain matmuls, no gather.
        self.single: int | None = self.active_slots[0] if len(uniq) == 1 and len(rows) == len(slots) else None
        if self.single is not None or not self.active_slots:
            return
        width = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        seg = torch.repeat_interleave(torch.arange(len(uniq)), counts)
        flat = seg * width + torch.arange(len(by_slot)) - starts[seg]
        gather = torch.zeros(len(uniq) * width, dtype=torch.int64)
        gather[flat] = by_slot
        self.gather = gather.view(len(uniq), width).to(device)  # padding points at row 0
        self.flat = flat.to(device)  # where each adapter row sits in the [S * width] layout
        self.rows = by_slot.to(device)
        self.slot_index = uniq.to(device)


class LoRAState:
    """The current step's ``LoRABatch`` (None outside a forward pass), shared by the wrappers
    of one model; set by ``LoRAManager.batch``."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A target linear layer plus the stacked adapters of every slot.

    The base layer runs as it is (its own matmul, packing or quantized weights); the wrapper
    adds the delta to its output. Column-parallel layers get their rank's output columns of B;
    row-parallel layers get their rank's input columns of A and add the delta to the partial
    sum before the all-reduce, so the reduction sums the deltas too.
    """

    def __init__(self, base: nn.Module, subs: list[tuple[Any, int, int]], in_features: int, max_loras: int,
                 max_rank: int, row_parallel: bool, state: LoRAState, dtype: torch.dtype,
                 device: torch.device) -> None:
        """``subs``: (sub-projection id, output offset, output size) on this rank."""
        super().__init__()
        self.base = base
        self.subs = subs
        self.max_rank = max_rank
        self.row_parallel = row_parallel
        self.state = state
        width = len(subs) * max_rank
        out = sum(size for _, _, size in subs)
        self.a = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out, dtype=dtype, device=device)
        self.has_weights = [False] * max_loras  # whether the slot's adapter targets this layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # q_size, kv_size, num_heads, ...: the base layer's
            return getattr(self._modules["base"], name)

    # ---- slots ---------------------------------------------------------------------------------
    def clear_slot(self, slot: int) -> None:
        if self.has_weights[slot]:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.has_weights[slot] = False

    def set_sub(self, slot: int, sub_index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection ``sub_index`` of ``slot``: ``a`` [r, in] and ``b`` [out, r] already
        sliced to this rank and scaled."""
        r, cols = a.shape[0], slice(sub_index * self.max_rank, sub_index * self.max_rank + a.shape[0])
        _, offset, size = self.subs[sub_index]
        self.a[slot, :, cols] = a.t().to(self.a.dtype)
        self.b[slot, cols, offset:offset + size] = b.t().to(self.b.dtype)
        assert r <= self.max_rank
        self.has_weights[slot] = True

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        active = batch is not None and any(self.has_weights[s] for s in batch.active_slots)
        if not self.row_parallel:
            y = self.base(x)
            return self._add_delta(x, y, batch) if active else y
        base = self.base
        y = base.matmul(x, None)
        if active:
            y = self._add_delta(x, y, batch)
        y = all_reduce(y)
        return y + base.bias if base.bias is not None else y

    def _add_delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        if batch.single is not None:
            s = batch.single
            return y.add_(torch.mm(torch.mm(x, self.a[s]), self.b[s]))
        xg = x[batch.gather]  # [S, width, in]
        h = torch.bmm(xg, self.a[batch.slot_index])
        delta = torch.bmm(h, self.b[batch.slot_index])
        return y.index_add_(0, batch.rows, delta.reshape(-1, y.shape[-1])[batch.flat])
