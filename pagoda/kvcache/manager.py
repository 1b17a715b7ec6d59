"""KV-cache manager: which blocks each sequence holds, prefix reuse and copy on write.

The scheduler asks it three things: how much of a prompt is cached (``match_prefix``), whether a
sequence can get the blocks for its next tokens (``allocate``), and to give a sequence's blocks
back (``free``). Pure Python: block ids only; the tensors live in the model runner.

Sliding window: when every attention layer has a window and prefix caching is off, the blocks
a sequence's next tokens can no longer attend to are given back as it advances
(``release_outside_window``); their block-table entries become ``WINDOW_PLACEHOLDER`` (a real
block id, only ever read under the window mask, never written), so positions still index the
table. With prefix caching on they are kept: every full block of a sequence enters the radix
tree, and the tree evicts leaves first, relying on a referenced node's ancestors being
referenced too. Dropping the head of a running sequence would leave unreferenced ancestors of
referenced nodes, counted as evictable but impossible to evict, so the capacity the scheduler
plans with would be wrong (it would promise blocks ``evict`` cannot produce).

KV tiers (``attach_tiers``): blocks the radix cache evicts, and blocks it caches, are handed to
the tiers' planner; ``extend_from_tiers`` brings a prompt's blocks back from them. The copies
travel to the model runner in ``take_transfers``.

Recurrent state (hybrid models, ``num_state_slots > 0``): beside its blocks each running
sequence holds one slot of a ``StatePool``, taken by ``allocate`` when it has none (admission,
or again after preemption), given back by ``free``; ``fork`` gives each sample its own slot and
queues a state copy (``take_state_copies``) from the parent's. ``allocate`` fails, changing
nothing, when no slot is free, exactly as when blocks are short. Such a manager matches no
prefix (``match_prefix``): a cached block holds K/V, not the recurrent state after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from pagoda.kvcache.block_pool import BlockPool
from pagoda.kvcache.block_table import BlockTable
from pagoda.kvcache.eviction import POLICIES
from pagoda.kvcache.radix_cache import RadixCache, RadixNode
from pagoda.kvcache.state_pool import StatePool
from pagoda.request import Sequence

if TYPE_CHECKING:
    from pagoda.kvcache.tiers.base import KVTransfers
    from pagoda.kvcache.tiers.planner import TierPlanner
    from pagoda.kvcache.tiers.store import LoadJob, TieredStore

# What a block-table entry released by the sliding window holds: any valid block id does, since
# the attention kernels never read outside the window and the pool holds only finite values.
WINDOW_PLACEHOLDER = 0
# Queued prompts that may hold blocks prefetched from the KV tiers at once (``prefetch``).
PREFETCH_LIMIT = 8
# ``allocate``'s shortcut for a running sequence whose blocks already hold its next tokens;
# tests turn it off to check it decides what the general path decides.
FAST_PATHS = True


class BlockHolder(Protocol):
    """What ``allocate``, ``trim`` and ``free`` read and write on whatever holds KV blocks: a
    scheduler ``Sequence``, or the draft model's per-sequence state (``DraftState``). Prefix
    matching, caching and forking need a whole ``Sequence``. ``block_table`` is a
    ``BlockTable`` (the manager assigns no other kind): the step builder copies its int32
    mirror."""

    block_table: BlockTable
    num_cached_blocks: int  # leading blocks that are in the prefix cache
    last_cached_node: RadixNode | None

    @property
    def num_computed_tokens(self) -> int:
        ...


@dataclass
class PrefixMatch:
    """Cached blocks found for a sequence's leading tokens."""

    nodes: list[RadixNode]
    num_tokens: int


@dataclass
class CacheStats:
    """Counters for metrics: prompt tokens looked up and found in the prefix cache."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru", sliding_window: int | None = None, num_state_slots: int = 0) -> None:
        self.block_size = block_size
        # Tokens every layer looks back over (None: some layer attends to everything); blocks
        # older than that are released only without prefix caching (see the module docstring).
        self.sliding_window = None if enable_prefix_caching else sliding_window
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, block_size, POLICIES[eviction_policy]) if enable_prefix_caching else None
        self.stats = CacheStats()
        self._pending_copies: list[tuple[int, int]] = []
        # Hybrid models: one recurrent-state slot per running sequence (None: no such layers).
        self.states = StatePool(num_state_slots) if num_state_slots else None
        self._pending_state_copies: list[tuple[int, int]] = []
        self.tiers: TierPlanner | None = None

    def attach_tiers(self, store: TieredStore, identity: bytes) -> None:
        """Extend the prefix cache with ``store``'s tiers, keying blocks under ``identity``."""
        from pagoda.kvcache.tiers.keys import BlockHasher
        from pagoda.kvcache.tiers.planner import TierPlanner

        assert self.cache is not None, "KV tiers need the prefix cache"
        hasher = BlockHasher(identity)
        self.tiers = TierPlanner(store, hasher)
        self.cache.attach_tiers(hasher, self.tiers)

    # ---- capacity ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: free ones plus unreferenced cached ones."""
        return self.pool.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached full blocks at the start of ``seq``, computed with the same LoRA adapter and
        cache salt (together the radix tree's namespace, ``Request.cache_namespace``). At least
        one token is always left to compute (its logits are needed), so a fully cached sequence
        gives back its last block. Requests for prompt logprobs, and embeddings pooled over
        every position's hidden state (MEAN, CLS), match nothing: a cached position is not
        computed again. LAST pooling reads only the last position, which always is."""
        if not self._matchable(seq):
            return PrefixMatch([], 0)
        nodes = self.cache.match(seq.cache_key_ids, seq.request.cache_namespace)
        if len(nodes) * self.block_size >= seq.num_tokens:
            nodes = nodes[:-1]
        return PrefixMatch(nodes, len(nodes) * self.block_size)

    def _matchable(self, seq: Sequence) -> bool:
        return not (self.cache is None or self.states is not None or seq.params.prompt_logprobs is not None
                    or seq.params.pooling in ("MEAN", "CLS"))

    def extend_from_tiers(self, seq: Sequence, prefix: PrefixMatch) -> PrefixMatch | None:
        """``prefix`` lengthened by the blocks after it that the KV tiers hold, or None while
        they are being read (``seq`` waits; ask again next step). The first call for a prompt
        starts the lookup (unless no tier can hold its next block); once it is done, the
        blocks found are entered into the radix tree, in free device blocks, and their copies
        queued for the model runner, and the prompt is matched again."""
        tiers = self.tiers
        if tiers is None or not self._matchable(seq):
            return prefix
        limit = (seq.num_tokens - 1) // self.block_size  # at least one token left to compute
        start = len(prefix.nodes)
        job = tiers.jobs.get(seq)
        if isinstance(job, tuple) or job is None:
            if start >= limit or job == (seq.num_tokens, start):
                return prefix  # nothing to ask for, or asked already
            return self._start_lookup(seq, prefix, start, limit)
        if not job.done:
            return None
        tiers.prefetched.discard(seq)
        if job.start > start and job.num_tokens == seq.num_tokens:
            del tiers.jobs[seq]  # the radix match shrank since the lookup began: ask from here
            return self.extend_from_tiers(seq, prefix)
        tiers.jobs[seq] = (seq.num_tokens, start)
        if job.payloads and job.num_tokens == seq.num_tokens:
            self._enter_loaded(seq, job)
            prefix = self.match_prefix(seq)
            tiers.jobs[seq] = (seq.num_tokens, len(prefix.nodes))
        return prefix

    def prefetch(self, seq: Sequence) -> None:
        """Start the KV-tier lookup of a prompt as it is queued, so that its blocks are read
        while it waits behind other requests; ``extend_from_tiers`` takes the result when the
        scheduler reaches it. Nothing enters the device here. At most ``PREFETCH_LIMIT``
        queued prompts hold prefetched blocks (they are bytes in memory); the rest ask when
        they are reached."""
        tiers = self.tiers
        if tiers is None or not self._matchable(seq) or seq in tiers.jobs or len(tiers.prefetched) >= PREFETCH_LIMIT:
            return
        prefix = self.match_prefix(seq)
        start, limit = len(prefix.nodes), (seq.num_tokens - 1) // self.block_size
        if start >= limit:
            return
        if self._lookup(seq, prefix, start, limit) in ("ready", "reading"):
            tiers.prefetched.add(seq)

    def _chain_keys(self, seq: Sequence, prefix: PrefixMatch, start: int, limit: int) -> list[bytes]:
        """Tier keys of ``seq``'s blocks ``start`` .. ``limit - 1`` (``prefix`` ending at ``start``)."""
        assert self.tiers is not None and self.cache is not None
        parent = prefix.nodes[-1].digest if prefix.nodes else self.cache.root_of(seq.request.cache_namespace).digest
        return self.tiers.hasher.keys(parent, seq.cache_key_ids, self.block_size, start, limit)

    def _start_lookup(self, seq: Sequence, prefix: PrefixMatch, start: int, limit: int) -> PrefixMatch | None:
        outcome = self._lookup(seq, prefix, start, limit)
        if outcome == "saving":
            return None  # evicted this step: its snapshot is taken when the step runs; ask then
        if outcome == "absent":
            assert self.tiers is not None
            self.tiers.jobs[seq] = (seq.num_tokens, start)
            return prefix
        return self.extend_from_tiers(seq, prefix) if outcome == "ready" else None

    def _lookup(self, seq: Sequence, prefix: PrefixMatch, start: int,
                limit: int) -> Literal["saving", "absent", "ready", "reading"]:
        """Start the tier lookup of ``seq``'s blocks ``start`` .. ``limit - 1`` and record its
        job in ``tiers.jobs``: "ready" when host memory alone answered it (no wait), "reading"
        while a lower tier is read. Records nothing when the first block is being saved this
        step ("saving": its snapshot is taken when the step runs) or no tier can hold it
        ("absent")."""
        tiers = self.tiers
        assert tiers is not None
        keys = self._chain_keys(seq, prefix, start, limit)
        if keys[0] in tiers.saving:
            return "saving"
        if not tiers.store.may_hold(keys[0]):
            return "absent"
        job = tiers.store.lookup_now(keys, start, seq.num_tokens)
        tiers.jobs[seq] = job or tiers.store.lookup_async(keys, start, seq.num_tokens)
        return "ready" if job is not None else "reading"

    def _enter_loaded(self, seq: Sequence, job: LoadJob) -> None:
        """Put ``job``'s blocks, from where the prompt's radix match ends now, into free device
        blocks under that match (as many as the pool can give without evicting the path)."""
        assert self.cache is not None and self.tiers is not None
        namespace, bs = seq.request.cache_namespace, self.block_size
        path = self.cache.match(seq.cache_key_ids, namespace)
        have = len(path)
        if have < job.start:
            return  # part of the chain before the loaded blocks was evicted meanwhile
        keys = seq.cache_key_ids
        held = [n.block for n in path]
        for block in held:  # so that allocating below cannot evict the path
            self._take(block)
        parent = path[-1] if path else None
        for i in range(have, job.start + len(job.payloads)):
            if self.num_free_blocks < 1:
                break
            block = self._new_block()
            node = self.cache.insert(parent, tuple(keys[i * bs:(i + 1) * bs]), block, namespace)
            j = i - job.start
            assert node.block == block and node.digest == job.keys[j], "a loaded block's key does not match"
            self.tiers.on_loaded(block, job.payloads[j], job.keys[j], job.sources[j])
            held.append(block)
            parent = node
        for block in reversed(held):
            self._drop(block)

    def take_transfers(self) -> KVTransfers | None:
        """Tier copies (saves, then loads) the model runner must do before the next forward."""
        return self.tiers.take() if self.tiers is not None else None

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq: BlockHolder, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Give ``seq`` blocks for its next ``num_new_tokens`` tokens (after taking the cached
        ``prefix`` blocks on admission). Returns False, changing nothing, if memory is short."""
        if prefix is None and self.states is None and FAST_PATHS:
            # A running sequence's next tokens (a decode's call, every step): when its blocks
            # already hold them and the block written is its own, there is nothing to do (what
            # the general path below concludes with no block needed and no copy on write).
            table, start = seq.block_table, seq.num_computed_tokens
            if start + num_new_tokens <= len(table) * self.block_size:
                idx = start // self.block_size
                if idx >= len(table) or self.pool.ref_counts[table[idx]] <= 1:
                    return True
        cached = prefix.nodes if prefix else []
        start = (len(cached) * self.block_size) if prefix else seq.num_computed_tokens
        have = len(cached) if prefix else len(seq.block_table)
        need = self.blocks_for(start + num_new_tokens) - have
        cow = self._needs_copy(seq, start) if not prefix else False
        # Taking a cached block off the evictable list uses up capacity too.
        revived = sum(1 for n in cached if self.pool.ref_counts[n.block] == 0) if cached else 0
        if max(need, 0) + cow + revived > self.num_free_blocks:
            return False
        if self.states is not None and getattr(seq, "state_slot", None) is None:
            if self.states.num_free == 0:
                return False
            seq.state_slot = self.states.allocate()  # type: ignore[attr-defined]
        for node in cached:
            self._take(node.block)
            seq.block_table.append(node.block)
        if prefix:
            seq.num_cached_blocks = len(cached)
            seq.last_cached_node = cached[-1] if cached else None
        if cow:
            self._copy_on_write(seq, start // self.block_size)
        for _ in range(need):
            seq.block_table.append(self._new_block())
        return True

    def _needs_copy(self, seq: BlockHolder, start: int) -> bool:
        """Writing at position ``start`` lands in a block another sequence shares."""
        idx = start // self.block_size
        return idx < len(seq.block_table) and self.pool.ref_counts[seq.block_table[idx]] > 1

    def _copy_on_write(self, seq: BlockHolder, idx: int) -> None:
        src = seq.block_table[idx]
        dst = self._new_block()
        self._pending_copies.append((src, dst))
        self._drop(src)
        seq.block_table[idx] = dst

    def _new_block(self) -> int:
        if self.pool.num_free == 0:
            assert self.cache is not None
            self.stats.evictions += self.cache.evict(1)
        return self.pool.allocate()

    def _take(self, block: int) -> None:
        if self.pool.incref(block) == 1 and self.cache is not None and block in self.cache:
            self.cache.on_referenced(block)

    def _drop(self, block: int) -> None:
        if self.pool.decref(block) == 0:
            if self.cache is not None and block in self.cache:
                self.cache.on_unreferenced(block)
            else:
                self.pool.release(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) the model runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_state_copies(self) -> list[tuple[int, int]]:
        """Recurrent-state copies (src slot, dst slot) to do before the next forward."""
        copies, self._pending_state_copies = self._pending_state_copies, []
        return copies

    # ---- caching and release -------------------------------------------------------------
    def cache_blocks(self, seq: Sequence) -> None:
        """Enter ``seq``'s newly completed, fully computed blocks into the prefix cache."""
        if self.cache is None:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        # Only the blocks completed since the last call: a decode step completes one block in
        # block_size steps, and keying the whole sequence again each step cost O(length).
        start = seq.num_cached_blocks
        if full <= start:
            return
        for idx, key in enumerate(self.cache.block_keys(seq.cache_key_ids, full, start), start):
            block = seq.block_table[idx]
            node = self.cache.insert(seq.last_cached_node, key, block, seq.request.cache_namespace)
            if node.block == block and self.tiers is not None:
                self.tiers.on_cached(node)
            if node.block != block:
                # Same content is cached already (computed by another sequence): share it.
                self._take(node.block)
                seq.block_table[idx] = node.block
                self._drop(block)
            seq.last_cached_node = node
            seq.num_cached_blocks = idx + 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks; the first write to a shared one copies it."""
        for block in parent.block_table[parent.num_window_released:]:
            self._take(block)
        child.num_window_released = parent.num_window_released
        child.block_table = parent.block_table.copy()
        child.num_cached_blocks = parent.num_cached_blocks
        child.last_cached_node = parent.last_cached_node
        child.num_computed_tokens = parent.num_computed_tokens
        if self.states is not None and parent.state_slot is not None:
            # A fork needs no free-slot check: the scheduler counts a prompt's n samples against
            # max_num_seqs when admitting it, and the pool has max_num_seqs slots.
            if self.states.num_free == 0:
                raise RuntimeError("no free recurrent-state slot for a forked sample")
            child.state_slot = self.states.allocate()
            self._pending_state_copies.append((parent.state_slot, child.state_slot))

    def free(self, seq: BlockHolder) -> None:
        """Release all of ``seq``'s blocks (cached ones stay in the tree, evictable)."""
        for block in reversed(seq.block_table[_released(seq):]):
            self._drop(block)
        seq.block_table = BlockTable()
        seq.num_cached_blocks = 0
        seq.last_cached_node = None
        slot = getattr(seq, "state_slot", None)
        if slot is not None and self.states is not None:
            self.states.release(slot)
            seq.state_slot = None  # type: ignore[attr-defined]
        if _released(seq):
            seq.num_window_released = 0  # type: ignore[attr-defined]

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back the leading blocks that no token from ``seq.num_computed_tokens`` on can
        attend to (each sees the last ``sliding_window`` positions up to itself). Returns how
        many were released now; 0 without a model-wide window or with prefix caching."""
        if self.sliding_window is None:
            return 0
        oldest_needed = seq.num_computed_tokens - self.sliding_window + 1
        upto = min(max(oldest_needed, 0) // self.block_size, len(seq.block_table))
        start = seq.num_window_released
        for idx in range(start, upto):
            self._drop(seq.block_table[idx])
            seq.block_table[idx] = WINDOW_PLACEHOLDER
        seq.num_window_released = max(start, upto)
        return max(upto - start, 0)

    def trim(self, seq: BlockHolder, num_tokens: int) -> None:
        """Release blocks beyond those needed for ``num_tokens`` (speculative rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._drop(seq.block_table.pop())

    def reset_prefix_cache(self) -> int:
        return self.cache.flush() if self.cache else 0

    def check_invariants(self, live: list[BlockHolder]) -> None:
        """Every block is exactly one of free, cached-unreferenced, or owned; counts match; each
        holder's block table agrees with its int32 mirror (what the step builder copies)."""
        owners: dict[int, int] = {}
        for seq in live:
            assert type(seq.block_table) is BlockTable, f"{seq}: block table is a {type(seq.block_table)}"
            assert seq.block_table.ints.tolist() == seq.block_table, f"{seq}: block table mirror out of step"
            for block in seq.block_table[_released(seq):]:
                owners[block] = owners.get(block, 0) + 1
        free = self.pool.free_block_ids()
        for block in range(self.num_blocks):
            count = self.pool.ref_counts[block]
            assert count >= 0
            assert count == owners.get(block, 0), f"block {block}: ref {count} != owners {owners.get(block, 0)}"
            in_cache = self.cache is not None and block in self.cache
            assert (block in free) == (count == 0 and not in_cache), f"block {block} state is inconsistent"
        if self.cache is not None:
            self.cache.check_invariants()
        if self.states is not None:
            self.states.check_invariants([s.state_slot for s in live if getattr(s, "state_slot", None) is not None])


def _released(seq: BlockHolder) -> int:
    """Leading block-table entries of ``seq`` the sliding window released (placeholders); the
    draft model's ``DraftState`` never releases any."""
    return getattr(seq, "num_window_released", 0)
