"""The host-memory tier: blocks evicted from the device pool, kept in RAM under a byte budget
(``--kv-offload-cpu-bytes``), least recently used dropped first. On a CPU engine "device" and
"host" are both RAM, but this is still a pool of its own, with its own budget.

Blocks are kept as plain payloads, not framed: this is the engine process's own memory, with
nothing between the write and the read that could corrupt or truncate a block, so a read is a
dictionary lookup, cheap enough for the step loop (``TieredStore.lookup_now``)."""
from __future__ import annotations

import threading
from collections import OrderedDict


class HostTier:
    name = "cpu"
    local = True  # reads without a network round trip (``TieredStore.wait_for_loads``)

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_offload_cpu_bytes must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
        return data

    def put(self, key: bytes, payload: bytes) -> None:
        data = payload
        if len(data) > self.capacity:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used -= len(old)
            while self._blocks and self.used + len(data) > self.capacity:
                _, dropped = self._blocks.popitem(last=False)
                self.used -= len(dropped)
            self._blocks[key] = data
            self.used += len(data)

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.used = 0
