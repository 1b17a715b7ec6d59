"""Slots of the recurrent-state cache (hybrid models' Mamba / linear-attention layers). Pure
Python: slot ids only; the state tensors live in the model's mixer layers.

Unlike KV blocks, a recurrent state is a fixed size per sequence whatever its length, and it is
overwritten in place at every step, so it cannot be shared: each running sequence owns exactly
one slot, from admission until it finishes or is preempted.
"""
from __future__ import annotations

from collections import deque


class StatePool:
    """Owns every slot id in ``[0, num_slots)``; a slot is either free or held by one sequence."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent-state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (the caller checks ``num_free`` first)."""
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self._held, f"state slot {slot} is not held"
        self._held.remove(slot)
        self._free.append(slot)

    def check_invariants(self, held: list[int]) -> None:
        """``held``: the slots the live sequences name; each exactly once, the rest free."""
        assert len(held) == len(set(held)), f"a state slot is held twice: {sorted(held)}"
        assert set(held) == self._held, f"held slots {sorted(self._held)} != live {sorted(held)}"
        assert len(self._free) + len(self._held) == self.num_slots
