"""KV blocks to and from the tiers' byte payloads: the model runner's half of the KV tiers
(the scheduler decides which blocks move, ``kvcache/tiers/planner.py``; this does the copies).

A block's payload is its bytes in every layer and plane (``[layers, planes, block_size,
heads, width]`` of the cache's storage dtype, as raw bytes), followed, for a quantized cache,
by its scales (``[layers, planes, block_size, heads]``). The layout's version is part of every
block key (``keys.LAYOUT_VERSION``).

Saves snapshot the blocks first, in the step thread, before anything in the step can write
them (one gather of whole per-layer block rows into a fresh tensor); turning the snapshot
into per-block bytes and the tier writes happen on the store's saver thread. Loads write payloads the loader thread read into
free blocks, before the forward pass that reads them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.kvcache.tiers.base import KVTransfers, SaveItem

if TYPE_CHECKING:
    from pagoda.kvcache.tiers.store import TieredStore


def _block_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[layers, planes, blocks, ...]``, contiguous) as uint8 ``[layers * planes, blocks,
    block bytes]``: one block of one layer and plane is a contiguous row of bytes."""
    b = t.view(torch.uint8)
    return b.view(b.shape[0] * b.shape[1], b.shape[2], -1)


class KVBlockCodec:
    """Copies blocks between a KV cache (and its scales) and a ``TieredStore``.

    A copy moves whole per-layer block rows (``_block_rows``), never single bytes: on the CPU
    with numpy's ``take`` / fancy assignment (one memcpy per row, single-threaded, so a busy
    machine's scheduling of torch's worker threads does not stretch it), elsewhere with one
    ``index_select`` / ``index_copy_`` per tensor."""

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, store: TieredStore) -> None:
        self.kv_cache = kv_cache  # the model runner's tensor (a new one after a wake-up: a new codec)
        self.parts = [_block_rows(kv_cache)] + ([_block_rows(kv_scales)] if kv_scales is not None else [])
        self.on_cpu = kv_cache.device.type == "cpu"
        self.store = store
        self.sizes = [p.shape[0] * p.shape[2] for p in self.parts]  # a block's bytes in each
        store.payload_bytes = sum(self.sizes)

    def transfer(self, transfers: KVTransfers) -> None:
        """Saves first (their blocks may be this step's load targets), then loads."""
        if transfers.saves:
            self.save(transfers.saves)
        if transfers.loads:
            self.load(transfers.loads)

    def save(self, items: list[SaveItem]) -> None:
        """Snapshot ``items``' blocks now ([n, payload bytes] on the CPU); the saver thread
        turns the rows into payloads."""
        blocks = [i.block for i in items]
        snap = torch.cat([self._gather(part, blocks) for part in self.parts], 1) if len(self.parts) > 1 \
            else self._gather(self.parts[0], blocks)
        self.store.save_async(items, lambda: [row.tobytes() for row in snap.numpy()])

    def _gather(self, part: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """Blocks ``blocks`` of ``part`` as CPU rows ``[n, layers * planes * block bytes]``."""
        n = len(blocks)
        if self.on_cpu:
            out = np.empty((n, part.shape[0], part.shape[2]), np.uint8)
            np.take(part.numpy(), blocks, axis=1, out=out.transpose(1, 0, 2))
            return torch.from_numpy(out).view(n, -1)
        idx = torch.tensor(blocks, device=part.device)
        return part.index_select(1, idx).transpose(0, 1).reshape(n, -1).to("cpu")

    def load(self, loads: list[tuple[int, bytes]]) -> None:
        """Write each payload into its block (all parts: values, then scales)."""
        n = len(loads)
        raw = np.frombuffer(b"".join(p for _, p in loads), np.uint8).reshape(n, -1)
        blocks = [b for b, _ in loads]
        col = 0
        for part, size in zip(self.parts, self.sizes):
            rows = raw[:, col:col + size].reshape(n, part.shape[0], part.shape[2])
            col += size
            if self.on_cpu:
                part.numpy()[:, blocks] = rows.transpose(1, 0, 2)
            else:
                src = torch.from_numpy(np.ascontiguousarray(rows.transpose(1, 0, 2)))
                part.index_copy_(1, torch.tensor(blocks, device=part.device), src.to(part.device))
