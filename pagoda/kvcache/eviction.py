"""Eviction strategies for the prefix cache: a key per node, the smallest key is evicted first."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pagoda.kvcache.radix_cache import RadixNode

EvictionPolicy = Callable[["RadixNode"], tuple]


def lru(node: "RadixNode") -> tuple:
    """Least recently used first."""
    return (node.last_access,)


def lfu(node: "RadixNode") -> tuple:
    """Least frequently hit first; ties broken by recency."""
    return (node.hit_count, node.last_access)


POLICIES: dict[str, EvictionPolicy] = {"lru": lru, "lfu": lfu}
