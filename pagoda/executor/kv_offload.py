"""KV blocks to and from the tiers' byte payloads: the model runner's half of the KV tiers
(the scheduler decides which blocks move, ``kvcache/tiers/planner.py``; this does the copies).

A block's payload is its bytes in every layer and plane (``[layers, planes, block_size,
heads, width]`` of the cache's storage dtype, as raw bytes), followed, for a quantized cache,
by its scales (``[layers, planes, block_size, heads]``). The layout's version is part of every
block key (``keys.LAYOUT_VERSION``).

Saves snapshot the blocks first, in the step thread, before anything in the step can write
them (one gather into a fresh tensor); turning the snapshot into per-block bytes and the tier
writes happen on the store's saver thread. Loads write payloads the loader thread read into
free blocks, before the forward pass that reads them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagoda.kvcache.tiers.base import KVTransfers, SaveItem

if TYPE_CHECKING:
    from pagoda.kvcache.tiers.store import TieredStore


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as uint8, its last dimension widened by the element size."""
    return t.view(torch.uint8)


class KVBlockCodec:
    """Copies blocks between a KV cache (and its scales) and a ``TieredStore``."""

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, store: TieredStore) -> None:
        self.cache = _bytes_view(kv_cache)  # [layers, planes, blocks, block_size, heads, width bytes]
        self.scales = _bytes_view(kv_scales) if kv_scales is not None else None
        self.store = store
        self.kv_bytes = self._block_bytes(self.cache)
        self.scale_bytes = self._block_bytes(self.scales) if self.scales is not None else 0
        store.payload_bytes = self.kv_bytes + self.scale_bytes

    @staticmethod
    def _block_bytes(t: torch.Tensor) -> int:
        return t[:, :, 0].numel()

    def transfer(self, transfers: KVTransfers) -> None:
        """Saves first (their blocks may be this step's load targets), then loads."""
        if transfers.saves:
            self.save(transfers.saves)
        if transfers.loads:
            self.load(transfers.loads)

    def save(self, items: list[SaveItem]) -> None:
        idx = torch.tensor([i.block for i in items], device=self.cache.device)
        n = len(items)
        # The snapshot: [n, bytes] on the CPU, taken now (the gather copies).
        parts = [self.cache[:, :, idx].movedim(2, 0).reshape(n, -1)]
        if self.scales is not None:
            parts.append(self.scales[:, :, idx].movedim(2, 0).reshape(n, -1))
        snap = (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).to("cpu")
        self.store.save_async(items, lambda: [row.numpy().tobytes() for row in snap])

    def load(self, loads: list[tuple[int, bytes]]) -> None:
        n = len(loads)
        raw = torch.frombuffer(bytearray(b"".join(p for _, p in loads)), dtype=torch.uint8).view(n, -1)
        idx = torch.tensor([b for b, _ in loads], device=self.cache.device)
        self._scatter(self.cache, raw[:, :self.kv_bytes], idx)
        if self.scales is not None:
            self._scatter(self.scales, raw[:, self.kv_bytes:], idx)

    @staticmethod
    def _scatter(dst: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor) -> None:
        """Write ``rows`` ([n, block bytes]) into blocks ``idx`` of ``dst``."""
        shape = (rows.shape[0], *dst.shape[:2], *dst.shape[3:])
        dst[:, :, idx] = rows.reshape(shape).movedim(0, 2).to(dst.device)
