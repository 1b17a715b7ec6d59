"""Radix tree over token ids at block granularity (RadixAttention).

Each edge is labelled by exactly one full block of token ids and each node owns the KV block
that holds those tokens, computed after the path from the root. A request's prompt is matched
block by block from the root; the longest path found is a prefix whose KV can be reused.

The tree holds no references of its own: a node's block is *referenced* when the pool's count
for it is > 0 (running sequences use it) and *evictable* otherwise. Because a sequence always
holds its whole prefix, a referenced node's ancestors are referenced too, so unreferenced nodes
can always be evicted leaves-first.

Trees are kept per namespace (any hashable; ``None`` is the base model's): a LoRA adapter's
KV differs from the base model's for the same tokens, so each adapter matches and inserts only
under its own root; a cache salt joins the namespace (``Request.cache_namespace``), so requests
with different salts never see each other's prefixes. Roots are the nodes with no parent.

With KV tiers (``tiers/``), every node also carries its block's content key (``digest``: the
model identity, the namespace and the token chain up to it, hashed by ``hasher``), and
``tiers`` hears of each eviction before the block goes back to the pool.
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Hashable, Iterator, Sequence

from pagoda.kvcache.block_pool import BlockPool
from pagoda.kvcache.eviction import EvictionPolicy, lru

if TYPE_CHECKING:
    from pagoda.kvcache.tiers.keys import BlockHasher
    from pagoda.kvcache.tiers.planner import TierPlanner

BlockKey = tuple[int, ...]


class RadixNode:
    __slots__ = ("key", "block", "parent", "children", "last_access", "hit_count", "digest")

    def __init__(self, key: BlockKey, block: int, parent: "RadixNode | None") -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[BlockKey, RadixNode] = {}
        self.last_access = 0
        self.hit_count = 0
        self.digest = b""  # the block's content key (only with KV tiers)

    def __repr__(self) -> str:
        return f"RadixNode(block={self.block}, children={len(self.children)})"


class RadixCache:
    """Maps cached token prefixes (whole blocks) to KV blocks, with pluggable eviction."""

    def __init__(self, pool: BlockPool, block_size: int, policy: EvictionPolicy = lru) -> None:
        self.pool = pool
        self.block_size = block_size
        self.policy = policy
        self.root = RadixNode((), -1, None)  # the base model's (namespace None)
        self._roots: dict[Hashable, RadixNode] = {None: self.root}
        self._by_block: dict[int, RadixNode] = {}
        self._clock = itertools.count(1)
        self.num_evictable = 0  # cached blocks with reference count 0
        self.num_evicted = 0
        self.hasher: BlockHasher | None = None
        self.tiers: TierPlanner | None = None

    def attach_tiers(self, hasher: BlockHasher, tiers: TierPlanner) -> None:
        """Key every node by content from now on and report evictions to ``tiers`` (call on an
        empty cache)."""
        assert not self._by_block, "attach tiers before anything is cached"
        self.hasher, self.tiers = hasher, tiers
        for namespace, root in self._roots.items():
            root.digest = hasher.root(namespace)

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, block: int) -> bool:
        return block in self._by_block

    @property
    def num_cached(self) -> int:
        return len(self._by_block)

    def nodes(self) -> Iterator[RadixNode]:
        """Every cached node (no roots), in no particular order; do not change the cache while
        iterating."""
        return iter(self._by_block.values())

    def block_keys(self, token_ids: Sequence[int], num_blocks: int, start: int = 0) -> Iterator[BlockKey]:
        """The keys of blocks ``start`` to ``num_blocks - 1`` of ``token_ids``."""
        bs = self.block_size
        for i in range(start, num_blocks):
            yield tuple(token_ids[i * bs:(i + 1) * bs])

    def root_of(self, namespace: Hashable = None) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode((namespace,), -1, None)
            if self.hasher is not None:
                root.digest = self.hasher.root(namespace)
        return root

    def match(self, token_ids: Sequence[int], namespace: Hashable = None) -> list[RadixNode]:
        """Longest cached path of full blocks that prefixes ``token_ids`` in ``namespace``'s
        tree. Marks them accessed."""
        node, path = self._roots.get(namespace), []
        if node is None:
            return path
        now = next(self._clock)
        for key in self.block_keys(token_ids, len(token_ids) // self.block_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            child.hit_count += 1
            path.append(child)
            node = child
        return path

    # ---- updates -------------------------------------------------------------------------
    def insert(self, parent: RadixNode | None, key: BlockKey, block: int, namespace: Hashable = None) -> RadixNode:
        """Cache ``block`` (holding ``key``) under ``parent`` (None = ``namespace``'s root).

        If the same content is cached already, the existing node is returned and ``block`` is
        not cached: the caller should switch to the cached block.
        """
        parent = parent or self.root_of(namespace)
        assert len(key) == self.block_size
        existing = parent.children.get(key)
        if existing is not None:
            existing.last_access = next(self._clock)
            return existing
        assert block not in self._by_block, f"block {block} is cached twice"
        node = RadixNode(key, block, parent)
        if self.hasher is not None:
            node.digest = self.hasher.chain(parent.digest, key)
        node.last_access = next(self._clock)
        parent.children[key] = node
        self._by_block[block] = node
        if self.pool.ref_counts[block] == 0:
            self.num_evictable += 1
        return node

    def on_referenced(self, block: int) -> None:
        """The pool count of cached ``block`` went 0 -> 1."""
        self.num_evictable -= 1

    def on_unreferenced(self, block: int) -> None:
        """The pool count of cached ``block`` went 1 -> 0: it stays cached, now evictable."""
        self.num_evictable += 1
        self._by_block[block].last_access = next(self._clock)

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` unreferenced blocks, leaves first, by policy order."""
        heap = [(self.policy(n), n.block, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = self._remove(node)
            freed += 1
            if parent.parent is not None and not parent.children and self.pool.ref_counts[parent.block] == 0:
                heapq.heappush(heap, (self.policy(parent), parent.block, parent))
        return freed

    def flush(self) -> int:
        """Evict everything evictable (used by tests and by ``reset_prefix_cache``)."""
        return self.evict(self.num_evictable)

    def _evictable_leaves(self) -> Iterator[RadixNode]:
        refs = self.pool.ref_counts
        for node in self._by_block.values():
            if not node.children and refs[node.block] == 0:
                yield node

    def _remove(self, node: RadixNode) -> RadixNode:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key]
        del self._by_block[node.block]
        self.num_evictable -= 1
        self.num_evicted += 1
        if self.tiers is not None:
            self.tiers.on_evict(node)  # before the block can be handed out again
        self.pool.release(node.block)
        if parent.parent is None and parent is not self.root and not parent.children:
            del self._roots[parent.key[0]]  # an adapter's tree emptied out
        return parent

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = self.pool.ref_counts
        evictable = 0
        for block, node in self._by_block.items():
            assert node.block == block and node.parent is not None
            assert node.parent.children.get(node.key) is node
            if refs[block] == 0:
                evictable += 1
            elif node.parent.parent is not None:
                assert refs[node.parent.block] > 0, "a referenced node has an unreferenced ancestor"
        assert evictable == self.num_evictable, (evictable, self.num_evictable)
