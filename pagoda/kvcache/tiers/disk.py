"""The local-disk tier (``--kv-offload-disk-path``, ``--kv-offload-disk-bytes``): one file per
block, named by its key, written atomically (a temporary file renamed into place), so a reader
never sees half a block and an engine restarted on the same directory finds every block it
left. Over the byte budget the least recently written or read files go first."""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from pagoda.kvcache.tiers.base import frame, unframe

logger = logging.getLogger(__name__)

SUFFIX = ".kvblock"


class DiskTier:
    name = "disk"
    local = True  # reads without a network round trip (``TieredStore.wait_for_loads``)

    def __init__(self, path: str, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_offload_disk_bytes must be positive, got {capacity_bytes}")
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # in LRU order
        self.used = 0
        self._scan()

    def _scan(self) -> None:
        """Index the blocks already on disk (oldest first), so a restarted engine finds them."""
        found = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                try:
                    key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                except ValueError:
                    continue
                st = entry.stat()
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self.used += size
        if found:
            logger.info("KV disk tier %s: %d blocks (%.1f MiB) found", self.root, len(found), self.used / 2**20)
        self._shrink()

    def _path(self, key: bytes) -> Path:
        return self.root / (key.hex() + SUFFIX)

    def get(self, key: bytes) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except OSError:
            self._forget(key)
            return None
        payload = unframe(key, data)
        if payload is None:
            logger.warning("KV disk tier: block %s is corrupt or truncated; dropped", key.hex())
            self._remove(key)
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return payload

    def put(self, key: bytes, payload: bytes) -> None:
        if self.contains(key):
            return
        data = frame(key, payload)
        # A temporary name of this key and thread (unique among writers here; one left by a
        # crash is overwritten or ignored), renamed into place once whole.
        tmp = self.root / f".tmp-{key.hex()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:  # (a regular file takes it whole; a short write goes on)
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self._path(key))
        except OSError:
            logger.warning("KV disk tier: writing block %s failed", key.hex(), exc_info=True)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._sizes[key] = len(data)
            self.used += len(data)
        self._shrink()

    def _shrink(self) -> None:
        while True:
            with self._lock:
                if self.used <= self.capacity or not self._sizes:
                    return
                key, size = self._sizes.popitem(last=False)
                self.used -= size
            self._path(key).unlink(missing_ok=True)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.used -= size

    def _remove(self, key: bytes) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def contains(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def close(self) -> None:
        """Nothing to release: the files stay for the next engine."""
