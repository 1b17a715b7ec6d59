"""The tier interface: a store of KV blocks outside the device pool, keyed by content.

A tier holds opaque byte payloads (one KV block: every layer's K and V bytes and, for a
quantized cache, their scales) under a block key (``keys.py``). Tiers know nothing of torch:
the model runner turns device blocks into payloads and back (``executor/kv_offload.py``).

Disk and Redis store every payload framed (``frame``): a magic, its length and a checksum over
the key and the payload, so a corrupt or truncated block read back from them is detected and
dropped (a miss: the block is recomputed) instead of feeding wrong KV to attention. (Host
memory, the engine's own, holds payloads as they are.)
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Protocol

_MAGIC = b"PGKV1\0"
_HEADER = struct.Struct("<6sQ16s")  # magic, payload length, blake2b-128 of key + payload


class Tier(Protocol):
    """One level below the device: host memory, local disk or a shared remote store.

    ``get`` returns the payload stored under ``key`` or None (absent, corrupt, unreachable);
    ``put`` stores one (best effort: a full or failing tier may drop it). Both may be called
    from worker threads; of the step loop's calls only the host-memory tier's ``get`` (no
    I/O) and, when nothing else can run, a whole lookup (``TieredStore.wait_for_loads``).
    ``contains`` answers from what the tier knows locally without I/O; a remote tier that
    cannot tell answers None ("ask ``get``"). ``local``: reads need no network round trip."""

    name: str
    local: bool

    def get(self, key: bytes) -> bytes | None:
        ...

    def put(self, key: bytes, payload: bytes) -> None:
        ...

    def contains(self, key: bytes) -> bool | None:
        ...

    def close(self) -> None:
        ...


def frame(key: bytes, payload: bytes) -> bytes:
    """``payload`` with the header ``unframe`` checks."""
    digest = hashlib.blake2b(key + payload, digest_size=16).digest()
    return _HEADER.pack(_MAGIC, len(payload), digest) + payload


def unframe(key: bytes, data: bytes) -> bytes | None:
    """The payload of a framed block, or None if ``data`` is not a whole, intact block of ``key``."""
    if len(data) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or length != len(payload):
        return None
    if hashlib.blake2b(key + payload, digest_size=16).digest() != digest:
        return None
    return payload


@dataclass
class SaveItem:
    """A device block to copy out before anything can overwrite it: its id, its key, and the
    tiers (by name) that should receive it."""

    block: int
    key: bytes
    tiers: tuple[str, ...]


@dataclass
class KVTransfers:
    """The tier copies a step's executor does before its forward pass, in this order:
    ``saves`` (device blocks to snapshot for the tiers; they may be reused by this very step,
    so the snapshot comes first), then ``loads`` (payloads read from a tier, written into free
    device blocks the prefix cache now holds)."""

    saves: list[SaveItem] = field(default_factory=list)
    loads: list[tuple[int, bytes]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)
