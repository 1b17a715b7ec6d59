"""The batched LoRA delta: ``LoRALinear`` wraps a target linear layer, ``LoRABatch`` groups a
step's token rows by adapter slot once per step.

Every wrapper keeps the adapters of all resident slots stacked, slot-major: ``a`` is
``[max_loras, in, W]`` with ``W = n_sub * max_rank`` (one rank-``max_rank`` block per
sub-projection of a fused layer: q/k/v, gate/up), so one matmul shrinks for every
sub-projection; ``b`` holds one ``[max_loras, max_rank, out_j]`` tensor per sub-projection
``j``, which expands into that sub-projection's own slice of the output. Scaling is folded into
``b``; ranks below ``max_rank`` are zero-padded.

Two ways to compute a step's delta, chosen once per step by ``LoRABatch`` (the same for every
layer), neither with a loop over requests or adapters:

- *single*: one adapter on every row: ``y += (x @ A_s) @ B_s``, a matmul and an ``addmm_``
  per sub-projection, in place on the base output.
- *segmented* (Punica's SGMV idea): the rows of each adapter form a segment; segments are laid
  out as ``[segments, length, in]`` (one gather of ``x``), one ``bmm`` shrinks every segment by
  its own adapter's A, one ``bmm`` per sub-projection expands by its B, and one ``index_add_``
  adds the rows (all sub-projections side by side) back into the base output. Only each row's own adapter is multiplied. When the
  active slots are adjacent (the usual case: slots fill from 0) the segments' A and B are
  views of the stacked tensors, not copies. Segments are padded to the longest; where that
  would more than double the rows (a long prefill chunk beside a few decode rows of other
  adapters), segments are cut into pieces of the fair share ``ceil(rows / adapters)`` instead
  (their A and B then gathered per piece).

- *dense* (decode CUDA graphs, ``LoRABatch.dense``): every row carries a one-hot row over the
  slots (all zeros: no adapter) in a device tensor, and nothing about the step is read on the
  host: one broadcast matmul shrinks every row by every slot's A, the one-hot picks each row's
  own, and one matmul per sub-projection expands the rows spread over the slots' blocks
  (``[rows, max_loras * max_rank]``) by all slots' B stacked. Shapes depend only on the row
  count, so a captured graph replays any mix of adapters; it reads every slot's A and B,
  which for decode batches is a small share of the base weights.

Rows without an adapter (slot -1) get no delta. A layer that no active adapter targets is
skipped altogether (not in dense mode: a graph must hold every layer's delta).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.distributed.parallel_state import all_reduce
from pagoda.transfer import to_device


# On a CPU, steps of at most this many rows compute the delta on one thread: their matmuls are
# too small to share, and a parallel region costs a wake-up of the other threads. (Under heavy
# load from other processes a larger bound, 64, halved a decode step's LoRA cost; on a quiet
# machine the two threads win from 32 rows on, see docs/benchmarks.md.)
ONE_THREAD_MAX_ROWS = 8


class LoRABatch:
    """One step's rows grouped by slot; built on the host from the per-row slot indices (or, by
    ``dense``, a device one-hot per row that the host never reads)."""

    one_hot: torch.Tensor | None = None

    @classmethod
    def dense(cls, one_hot: torch.Tensor) -> "LoRABatch":
        """The dense way over ``one_hot`` ``[rows, max_loras]`` (model dtype, on the device)."""
        batch = cls.__new__(cls)
        batch.one_hot, batch.active_slots, batch.single = one_hot, [], None
        return batch

    @staticmethod
    def one_hot_rows(slots: torch.Tensor, max_loras: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, max_loras]`` host rows for ``dense``: 1 at each row's slot, none for -1."""
        return torch.nn.functional.one_hot(slots.to("cpu", torch.int64) + 1, max_loras + 1)[:, 1:].to(dtype)

    def __init__(self, slots: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        slots = slots.to("cpu", torch.int64)
        rows = torch.nonzero(slots >= 0).flatten()
        by_slot = rows[torch.argsort(slots[rows], stable=True)]
        uniq, counts = torch.unique_consecutive(slots[by_slot], return_counts=True)
        self.active_slots: list[int] = uniq.tolist()
        self.single: int | None = None
        if not self.active_slots:
            return
        if len(uniq) == 1 and len(rows) == len(slots):  # the whole batch on one adapter
            self.single = self.active_slots[0]
            return
        # Pieces: segments cut to at most `length` rows, each padded to `length`: the longest
        # segment, unless padding to it would more than double the rows (then the fair share).
        length = int(counts.max())
        if len(uniq) * length > 2 * len(by_slot):
            length = -(-len(by_slot) // len(uniq))
        pieces = -(-counts // length)  # per segment
        n = int(pieces.sum())
        piece_slot = torch.repeat_interleave(uniq, pieces)
        piece_of_segment_start = torch.cumsum(pieces, 0) - pieces
        seg_start = torch.cumsum(counts, 0) - counts
        seg = torch.repeat_interleave(torch.arange(len(uniq)), counts)
        pos = torch.arange(len(by_slot)) - seg_start[seg]  # position inside its segment
        flat = (piece_of_segment_start[seg] + pos // length) * length + pos % length
        gather = torch.zeros(n * length, dtype=torch.int64)  # padding reads row 0
        gather[flat] = by_slot
        # The deltas go back with one scatter-add; padding adds its (zeroed) delta to row 0.
        self.index = to_device(gather, device)  # (sent without waiting for the device)
        self.gather = self.index.view(n, length)
        self.pieces = n
        self.valid: torch.Tensor | None = None
        if n * length > len(by_slot):
            valid = torch.zeros(n * length, dtype=dtype)
            valid[flat] = 1
            self.valid = to_device(valid, device).view(n, length, 1)
        adjacent = n == len(uniq) and self.active_slots[-1] - self.active_slots[0] + 1 == n
        # A view of the stacked tensors where the pieces are exactly slots lo..hi-1, else indices
        self.slot_range: tuple[int, int] | None = (self.active_slots[0], self.active_slots[-1] + 1) if adjacent \
            else None
        self.piece_slots = to_device(piece_slot, device)


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
        self.in_features = in_features
        self.a = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        # One B per sub-projection, [max_loras, max_rank, its output size]: each slice of a
        # fused layer's output is expanded by its own B (no block-diagonal zeros to multiply).
        self.b = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for _, _, size in subs]
        self.has_weights = [False] * max_loras  # whether the slot's adapter targets this layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # q_size, kv_size, num_heads, ...: the base layer's
            return getattr(self._modules["base"], name)

    # ---- slots ---------------------------------------------------------------------------------
    def clear_slot(self, slot: int) -> None:
        if self.has_weights[slot]:
            self.a[slot] = 0
            for b in self.b:
                b[slot] = 0
            self.has_weights[slot] = False

    def set_sub(self, slot: int, sub_index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection ``sub_index`` of ``slot``: ``a`` [r, in] and ``b`` [out, r] already
        sliced to this rank and scaled."""
        r = a.shape[0]
        assert r <= self.max_rank
        start = sub_index * self.max_rank
        self.a[slot, :, start:start + r] = a.t().to(self.a.dtype)
        self.b[sub_index][slot, :r] = b.t().to(self.a.dtype)
        self.has_weights[slot] = True

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        active = batch is not None and (batch.one_hot is not None
                                        or any(self.has_weights[s] for s in batch.active_slots))
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

    def _dense_delta(self, x: torch.Tensor, y: torch.Tensor, one_hot: torch.Tensor) -> torch.Tensor:
        r, slots = self.max_rank, one_hot.shape[1]
        h = torch.matmul(x, self.a)  # [slots, rows, W]: every row shrunk by every slot's A
        h = (h * one_hot.t().unsqueeze(2)).sum(0)  # each row's own slot (zeros without one)
        for j, (_, offset, size) in enumerate(self.subs):
            spread = (one_hot.unsqueeze(2) * h[:, None, j * r:(j + 1) * r]).reshape(x.shape[0], slots * r)
            out = y if len(self.subs) == 1 else y[:, offset:offset + size]
            out.addmm_(spread, self.b[j].view(slots * r, size))
        return y

    def _delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        r = self.max_rank
        if batch.one_hot is not None:
            return self._dense_delta(x, y, batch.one_hot)
        if batch.single is not None:
            h = torch.mm(x, self.a[batch.single])
            if len(self.subs) == 1:
                return y.addmm_(h, self.b[0][batch.single])
            for j, (_, offset, size) in enumerate(self.subs):
                y[:, offset:offset + size].addmm_(h[:, j * r:(j + 1) * r], self.b[j][batch.single])
            return y
        if batch.slot_range is not None:
            lo, hi = batch.slot_range
            a = self.a[lo:hi]
        else:
            a = self.a[batch.piece_slots]
        h = torch.bmm(x[batch.gather], a)  # [pieces, length, W]: each row shrunk by its own A
        if batch.valid is not None:
            h.mul_(batch.valid)  # padding rows add nothing
        bs = [b[lo:hi] if batch.slot_range is not None else b[batch.piece_slots] for b in self.b]
        if len(self.subs) == 1:
            delta = torch.bmm(h, bs[0])
        else:  # the sub-projections' deltas side by side, as in the output
            delta = torch.cat([torch.bmm(h[:, :, j * r:(j + 1) * r], b) for j, b in enumerate(bs)], dim=2)
        # One scatter-add over whole rows of the base output (a column slice of it would take
        # a strided path several times slower).
        return y.index_add_(0, batch.index, delta.view(-1, y.shape[1]))
