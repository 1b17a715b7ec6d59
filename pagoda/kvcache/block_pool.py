"""A fixed pool of KV-cache blocks with reference counts. Pure Python: no torch."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Owns every block id in ``[0, num_blocks)``.

    Invariant: a block is in ``free`` iff its reference count is 0 and no cache holds it.
    Blocks with count 0 that a prefix cache still holds are the cache's business (evictable).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        block = self._free.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> int:
        self.ref_counts[block] += 1
        return self.ref_counts[block]

    def decref(self, block: int) -> int:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise AssertionError(f"block {block} released more often than taken")
        self.ref_counts[block] = count
        return count

    def release(self, block: int) -> None:
        """Return an unreferenced block to the free list."""
        assert self.ref_counts[block] == 0, f"block {block} is still referenced"
        self._free.append(block)

    def free_block_ids(self) -> set[int]:
        return set(self._free)
