"""The batched LoRA delta: ``LoRALinear`` wraps a target linear layer, ``LoRABatch`` groups a
step's token rows by adapter slot once per step.

Every wrapper keeps the adapters of all resident slots stacked: ``a`` is
``[in, max_loras * W]`` with ``W = n_sub * max_rank`` (slot ``s`` owns columns ``s*W:(s+1)*W``,
one rank-``max_rank`` block per sub-projection of a fused layer: q/k/v, gate/up), so one matmul
shrinks for every sub-projection; ``b`` holds one ``[max_loras * max_rank, out_j]`` matrix per
sub-projection ``j`` (slot ``s`` owns rows ``s*R:(s+1)*R``), which expands into that
sub-projection's own slice of the output. Scaling is folded into ``b``; ranks below
``max_rank`` are zero-padded.

Three ways to compute a step's delta, chosen once per step by ``LoRABatch`` (the same for
every layer), none with a loop over requests or adapters:

- *single*: one adapter on every row: ``y += (x @ A_s) @ B_s``, a matmul and an ``addmm_``
  per sub-projection.
- *masked* (few rows times few slots, e.g. decode steps): the slots from the lowest to the
  highest active one are adjacent columns of ``a`` and rows of ``b``, so one matmul shrinks
  every row by all of them, a per-row mask keeps each row's own adapter's block, and an
  ``addmm_`` per sub-projection expands: a fixed number of ops whatever the number of
  adapters, at the price of the flops of the other adapters' blocks.
- *segmented* (Punica's SGMV idea; large prefill steps over many adapters): rows sorted by
  slot are laid out as ``[active slots, longest segment]``, one ``bmm`` shrinks and one expands
  for all adapters at once, and ``index_add_`` puts the rows back.

Rows without an adapter (slot -1) get no delta. A layer that no active adapter targets is
skipped altogether.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.distributed.parallel_state import all_reduce


# On a CPU, steps of at most this many rows compute the delta on one thread: their matmuls are
# too small to share, and a parallel region costs a wake-up of the other threads. (Under heavy
# load from other processes a larger bound, 64, halved a decode step's LoRA cost; on a quiet
# machine the two threads win from 32 rows on, see docs/benchmarks.md.)
ONE_THREAD_MAX_ROWS = 8

# The masked way is taken while rows x adjacent slots stays under this: its wasted flops grow
# with both, its fixed three ops win on small (decode) steps.
MASKED_MAX_ROW_SLOTS = 256


class LoRABatch:
    """One step's rows grouped by slot; built on the host from the per-row slot indices."""

    def __init__(self, slots: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        slots = slots.to("cpu", torch.int64)
        rows = torch.nonzero(slots >= 0).flatten()
        by_slot = rows[torch.argsort(slots[rows], stable=True)]
        uniq, counts = torch.unique_consecutive(slots[by_slot], return_counts=True)
        self.active_slots: list[int] = uniq.tolist()
        self.single: int | None = None
        self.mask: torch.Tensor | None = None
        if not self.active_slots:
            return
        if len(uniq) == 1 and len(rows) == len(slots):  # the whole batch on one adapter
            self.single = self.active_slots[0]
            return
        self.lo, self.hi = self.active_slots[0], self.active_slots[-1] + 1
        if len(slots) * (self.hi - self.lo) <= MASKED_MAX_ROW_SLOTS:
            # [T, slots lo..hi-1]: 1 where the row's adapter is that slot
            self.mask = (slots[:, None] == torch.arange(self.lo, self.hi)[None, :]).to(dtype)[:, :, None].to(device)
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
        self.width = width = len(subs) * max_rank
        self.a = torch.zeros(in_features, max_loras * width, dtype=dtype, device=device)
        # One B per sub-projection, [max_loras * max_rank, its output size]: each slice of a
        # fused layer's output is expanded by its own B (no block-diagonal zeros to multiply).
        self.b = [torch.zeros(max_loras * max_rank, size, dtype=dtype, device=device) for _, _, size in subs]
        self.has_weights = [False] * max_loras  # whether the slot's adapter targets this layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # q_size, kv_size, num_heads, ...: the base layer's
            return getattr(self._modules["base"], name)

    # ---- slots ---------------------------------------------------------------------------------
    def _cols(self, slot: int) -> slice:
        return slice(slot * self.width, (slot + 1) * self.width)

    def _rows(self, slot: int) -> slice:
        return slice(slot * self.max_rank, (slot + 1) * self.max_rank)

    def clear_slot(self, slot: int) -> None:
        if self.has_weights[slot]:
            self.a[:, self._cols(slot)] = 0
            for b in self.b:
                b[self._rows(slot)] = 0
            self.has_weights[slot] = False

    def set_sub(self, slot: int, sub_index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection ``sub_index`` of ``slot``: ``a`` [r, in] and ``b`` [out, r] already
        sliced to this rank and scaled."""
        r = a.shape[0]
        assert r <= self.max_rank
        start = slot * self.width + sub_index * self.max_rank
        self.a[:, start:start + r] = a.t().to(self.a.dtype)
        self.b[sub_index][slot * self.max_rank:slot * self.max_rank + r] = b.t().to(self.a.dtype)
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
        if x.device.type != "cpu" or x.shape[0] > ONE_THREAD_MAX_ROWS:
            return self._delta(x, y, batch)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._delta(x, y, batch)
        finally:
            torch.set_num_threads(threads)

    def _delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        w, r = self.width, self.max_rank
        if batch.single is not None:
            h = torch.mm(x, self.a[:, self._cols(batch.single)])
            return self._expand(y, h.view(h.shape[0], 1, w), self._rows(batch.single))
        if batch.mask is not None:
            h = torch.mm(x, self.a[:, batch.lo * w:batch.hi * w]).view(x.shape[0], -1, w)
            h.mul_(batch.mask)  # each row keeps its own adapter's block
            return self._expand(y, h, slice(batch.lo * r, batch.hi * r))
        a = self.a.view(self.a.shape[0], -1, w).transpose(0, 1)  # [slots, in, W]
        h = torch.bmm(x[batch.gather], a[batch.slot_index])  # [S, longest segment, W]
        for j, (_, offset, size) in enumerate(self.subs):
            b = self.b[j].view(-1, r, size)[batch.slot_index]
            delta = torch.bmm(h[:, :, j * r:(j + 1) * r], b)
            y[:, offset:offset + size].index_add_(0, batch.rows, delta.reshape(-1, size)[batch.flat])
        return y

    def _expand(self, y: torch.Tensor, h: torch.Tensor, rows: slice) -> torch.Tensor:
        """``y[:, slice j] += h_j @ B_j[rows]`` per sub-projection; ``h`` is [T, slots, W]."""
        t, r = h.shape[0], self.max_rank
        if len(self.subs) == 1:
            return y.addmm_(h.view(t, -1), self.b[0][rows])
        for j, (_, offset, size) in enumerate(self.subs):
            y[:, offset:offset + size].addmm_(h[:, :, j * r:(j + 1) * r].reshape(t, -1), self.b[j][rows])
        return y
