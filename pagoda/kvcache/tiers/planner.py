"""The scheduler's side of the KV tiers: which device blocks go out to the tiers and which come
back. Pure Python, block ids and keys only; the model runner does the copies
(``KVTransfers``), the store's threads do the I/O.

Policy (per tier, fixed):

- **host memory is filled on eviction**: a block the radix cache evicts from the device pool is
  snapshotted (before this step's forward pass can overwrite it) and kept in host memory. It
  costs a copy only when the device has to drop a block.
- **disk and Redis are written through**: every block the device caches (a full, computed
  block entering the radix tree) is written to them once, as it completes, so a restarted
  engine and the other engines sharing the Redis find it even while it is still on this
  device. Without a host tier, evicted blocks they do not hold yet go to the first of them.

A lookup (``KVCacheManager.extend_from_tiers``) asks for the blocks after a prompt's radix
match; the request waits in the queue while the loader reads them, then the blocks found are
written into free device blocks and entered into the radix tree, where the prompt matches them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary, WeakSet

from pagoda.kvcache.tiers.base import KVTransfers, SaveItem
from pagoda.kvcache.tiers.keys import BlockHasher
from pagoda.kvcache.tiers.store import LoadJob, TieredStore

if TYPE_CHECKING:
    from pagoda.kvcache.radix_cache import RadixNode
    from pagoda.request import Sequence

# Keys this engine wrote through (or loaded from a persistent tier): not written again.
KNOWN_KEYS_LIMIT = 1 << 20


class TierPlanner:
    def __init__(self, store: TieredStore, hasher: BlockHasher) -> None:
        self.store = store
        self.hasher = hasher
        self.persistent = tuple(t.name for t in store.tiers if t.name != "cpu")
        self.first = store.tiers[0].name
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._transfers = KVTransfers()
        self._loading: set[int] = set()  # blocks with a load in ``_transfers``
        self.saving: set[bytes] = set()  # keys with a save in ``_transfers`` (not yet queued)
        # A waiting sequence's lookup in flight, or the (num_tokens, start block) it last asked for.
        self.jobs: WeakKeyDictionary[Sequence, LoadJob | tuple[int, int]] = WeakKeyDictionary()
        # Queued sequences whose lookup was started on arrival and not taken yet (an aborted
        # one drops out with the sequence).
        self.prefetched: WeakSet[Sequence] = WeakSet()

    # ---- blocks going out ----------------------------------------------------------------
    def on_cached(self, node: RadixNode) -> None:
        """A computed block entered the radix tree: write it through to disk / Redis."""
        if self.persistent and not self._is_known(node.digest):
            self._remember(node.digest)
            self._save(SaveItem(node.block, node.digest, self.persistent))

    def on_evict(self, node: RadixNode) -> None:
        """The radix cache drops ``node``: keep its block in the first tier that lacks it."""
        if node.block in self._loading:
            # Its load has not run yet: the block never held these values (a tier has them).
            self._loading.discard(node.block)
            self._transfers.loads = [(b, p) for b, p in self._transfers.loads if b != node.block]
            return
        if self.first in self.persistent and self._is_known(node.digest):
            return
        if self.store.by_name[self.first].contains(node.digest):
            return
        self._save(SaveItem(node.block, node.digest, (self.first,)))

    def _save(self, item: SaveItem) -> None:
        self._transfers.saves.append(item)
        self.saving.add(item.key)

    # ---- blocks coming in ----------------------------------------------------------------
    def on_loaded(self, block: int, payload: bytes, key: bytes, source: str) -> None:
        """``payload`` (read from tier ``source``) goes into free device ``block`` this step."""
        self._transfers.loads.append((block, payload))
        self._loading.add(block)
        if source in self.persistent:
            self._remember(key)

    def take(self) -> KVTransfers | None:
        """The copies to do before the next forward pass (None: nothing to do)."""
        if not self._transfers:
            return None
        out, self._transfers = self._transfers, KVTransfers()
        self._loading.clear()
        self.saving.clear()
        return out

    # ---- known keys ----------------------------------------------------------------------
    def _is_known(self, key: bytes) -> bool:
        return key in self._known

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        if len(self._known) > KNOWN_KEYS_LIMIT:
            self._known.popitem(last=False)
