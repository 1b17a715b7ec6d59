"""KV cache tiers below the device pool: host memory, local disk, Redis.

``make_tiered_store(config)`` builds the configured tiers (None when no ``--kv-offload-*``
flag is given); the engine core hands the store to the KV-cache manager (``TierPlanner``:
which blocks move) and to the model runner (``executor/kv_offload.py``: the copies).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.kvcache.tiers.store import TieredStore

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

# --kv-offload-disk-bytes when a disk path is given without a size.
DEFAULT_DISK_BYTES = 16 << 30


def make_tiered_store(config: "EngineConfig") -> TieredStore | None:
    """The tiers ``config.cache.offload`` asks for, in lookup order (host, disk, Redis)."""
    off = config.cache.offload
    if off is None:
        return None
    tiers = []
    if off.cpu_bytes:
        from pagoda.kvcache.tiers.host import HostTier

        tiers.append(HostTier(off.cpu_bytes))
    if off.disk_path:
        from pagoda.kvcache.tiers.disk import DiskTier

        tiers.append(DiskTier(off.disk_path, off.disk_bytes or DEFAULT_DISK_BYTES))
    if off.redis_url:
        from pagoda.kvcache.tiers.redis import RedisTier

        tiers.append(RedisTier(off.redis_url))
    return TieredStore(tiers)
