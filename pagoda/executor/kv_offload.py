"""KV blocks to and from the tiers' byte payloads: the model runner's half of the KV tiers
(the scheduler decides which blocks move, ``kvcache/tiers/planner.py``; this does the copies).

A block's payload is its bytes in every layer and plane (``[layers, planes, block_size,
heads, width]`` of the cache's storage dtype, as raw bytes), followed, for a quantized cache,
by its scales (``[layers, planes, block_size, heads]``). The layout's version is part of every
block key (``keys.LAYOUT_VERSION``).

Under tensor (and pipeline) parallelism every rank holds its own share of each block (its KV
heads of its stage's layers), and a payload is all the shares, in world-rank order
(``ShardedKVCodec``): rank 0's store keeps it under the block's one key, so a block is in a
tier whole or not at all.

Saves snapshot the blocks first, in the step thread, before anything in the step can write
them (one gather of whole per-layer block rows into a fresh tensor); turning the snapshot
into per-block bytes and the tier writes happen on the store's saver thread. Loads write payloads the loader thread read into
free blocks, before the forward pass that reads them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from pagoda.distributed.parallel_state import get_pp, host_all_gather, host_gather
from pagoda.kvcache.tiers.base import KVTransfers, SaveItem

if TYPE_CHECKING:
    from pagoda.kvcache.tiers.store import TieredStore


def _block_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[layers, planes, blocks, ...]``, contiguous) as uint8 ``[layers * planes, blocks,
    block bytes]``: one block of one layer and plane is a contiguous row of bytes."""
    b = t.view(torch.uint8)
    return b.view(b.shape[0] * b.shape[1], b.shape[2], -1)


def _to_pinned_host(rows: torch.Tensor) -> torch.Tensor:
    """Device rows as a fresh host tensor, complete on return. From a CUDA device the copy goes
    into page-locked (pinned) memory, a DMA at the link's full speed, where a pageable
    destination is staged through a bounce buffer; other devices copy as torch does."""
    if rows.device.type != "cuda":
        return rows.to("cpu")
    out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    out.copy_(rows, non_blocking=True)
    torch.cuda.current_stream(rows.device).synchronize()
    return out


class KVBlockCodec:
    """Copies blocks between a KV cache (and its scales) and a ``TieredStore``.

    A copy moves whole per-layer block rows (``_block_rows``), never single bytes: on the CPU
    with numpy's ``take`` / fancy assignment (one memcpy per row, single-threaded, so a busy
    machine's scheduling of torch's worker threads does not stretch it), elsewhere with one
    ``index_select`` / ``index_copy_`` per tensor."""

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, store: TieredStore | None) -> None:
        self.kv_cache = kv_cache  # the model runner's tensor (a new one after a wake-up: a new codec)
        self.parts = [_block_rows(kv_cache)] + ([_block_rows(kv_scales)] if kv_scales is not None else [])
        self.on_cpu = kv_cache.device.type == "cpu"
        self.store = store  # None on a tensor-parallel worker: rank 0 holds the store
        self.sizes = [p.shape[0] * p.shape[2] for p in self.parts]  # a block's bytes in each
        self.block_bytes = sum(self.sizes)  # this cache's share of a block
        if store is not None:
            store.payload_bytes = self.block_bytes

    def transfer(self, transfers: KVTransfers) -> None:
        """Saves first (their blocks may be this step's load targets), then loads."""
        if transfers.saves:
            self.save(transfers.saves)
        if transfers.loads:
            self.load(transfers.loads)

    def save(self, items: list[SaveItem]) -> None:
        """Snapshot ``items``' blocks now ([n, payload bytes] on the CPU); the saver thread
        turns the rows into payloads."""
        snap = self.snapshot([i.block for i in items])
        self.store.save_async(items, lambda: [row.tobytes() for row in snap.numpy()])

    def snapshot(self, blocks: list[int]) -> torch.Tensor:
        """Blocks ``blocks`` of this cache as CPU rows ``[n, block_bytes]`` (a fresh tensor)."""
        if len(self.parts) > 1:
            return torch.cat([self._gather(part, blocks) for part in self.parts], 1)
        return self._gather(self.parts[0], blocks)

    def _gather(self, part: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """Blocks ``blocks`` of ``part`` as CPU rows ``[n, layers * planes * block bytes]``."""
        n = len(blocks)
        if self.on_cpu:
            out = np.empty((n, part.shape[0], part.shape[2]), np.uint8)
            np.take(part.numpy(), blocks, axis=1, out=out.transpose(1, 0, 2))
            return torch.from_numpy(out).view(n, -1)
        idx = torch.tensor(blocks, device=part.device)
        return _to_pinned_host(part.index_select(1, idx).transpose(0, 1).reshape(n, -1))

    def load(self, loads: list[tuple[int, bytes]]) -> None:
        """Write each payload into its block (all parts: values, then scales)."""
        raw = np.frombuffer(b"".join(p for _, p in loads), np.uint8).reshape(len(loads), -1)
        self.write([b for b, _ in loads], raw)

    def write(self, blocks: list[int], raw: np.ndarray) -> None:
        """Write rows ``raw`` (``[n, block_bytes]`` uint8, as ``snapshot`` returns them) into ``blocks``."""
        n = len(blocks)
        col = 0
        for part, size in zip(self.parts, self.sizes):
            rows = raw[:, col:col + size].reshape(n, part.shape[0], part.shape[2])
            col += size
            if self.on_cpu:
                part.numpy()[:, blocks] = rows.transpose(1, 0, 2)
            else:
                src = torch.from_numpy(np.ascontiguousarray(rows.transpose(1, 0, 2)))
                if part.device.type == "cuda":  # staged in page-locked memory: a DMA the stream orders
                    src = src.pin_memory().to(part.device, non_blocking=True)
                part.index_copy_(1, torch.tensor(blocks, device=part.device), src.to(part.device))


class ShardedKVCodec:
    """The codec of one rank of a tensor / pipeline-parallel engine. Every rank builds one at
    the same time (``ranks`` learns each rank's share of a block), and every rank calls
    ``run`` with the same message (rank 0's ``encode``d ``KVTransfers``) at the same time:
    each snapshots its share of the saved blocks, rank 0 gathers the shares and hands whole
    payloads to its store (the only one: ``store`` is None on the other ranks); each writes its
    columns of the loaded payloads into its own cache. The scheduler's decisions, keys and
    lookups are those of one engine: no rank reads a tier, and a block's shares never part."""

    def __init__(self, codec: KVBlockCodec) -> None:
        self.codec = codec
        self.shares = [int(v[0]) for v in host_all_gather([float(codec.block_bytes)])]
        rank = get_pp().world_rank
        self.columns = slice(sum(self.shares[:rank]), sum(self.shares[:rank + 1]))
        if codec.store is not None:
            codec.store.payload_bytes = sum(self.shares)

    @staticmethod
    def encode(transfers: KVTransfers) -> bytes:
        """What the other ranks need of ``transfers``: the saved blocks, the loaded blocks and payloads."""
        return msgspec.msgpack.encode(([i.block for i in transfers.saves], [b for b, _ in transfers.loads],
                                       b"".join(p for _, p in transfers.loads)))

    def run(self, message: bytes, saves: list[SaveItem] | None = None) -> None:
        """Do the transfers of ``message`` on this rank (``saves``: rank 0's items, with their keys)."""
        save_blocks, load_blocks, raw = msgspec.msgpack.decode(message, type=tuple[list[int], list[int], bytes])
        if save_blocks:
            self._save(save_blocks, saves or [])
        if load_blocks:
            rows = np.frombuffer(raw, np.uint8).reshape(len(load_blocks), -1)
            self.codec.write(load_blocks, rows[:, self.columns])

    def _save(self, blocks: list[int], items: list[SaveItem]) -> None:
        snap = self.codec.snapshot(blocks)
        width = max(self.shares)
        if snap.shape[1] < width:  # gather needs one shape on every rank (stages may differ)
            snap = torch.cat([snap, snap.new_zeros(len(blocks), width - snap.shape[1])], 1)
        parts = host_gather(snap)
        if parts is None or self.codec.store is None:
            return
        shares = self.shares

        def payloads() -> list[bytes]:  # on the saver thread
            whole = torch.cat([p[:, :n] for p, n in zip(parts, shares)], 1)
            return [row.tobytes() for row in whole.numpy()]

        self.codec.store.save_async(items, payloads)
