"""Block pool, radix tree and KV-cache manager with no model: exact block ids and invariants."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagoda.kvcache.manager import KVCacheManager
from pagoda.request import Request, Sequence
from pagoda.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    req = Request(rid, list(tokens), SamplingParams(max_tokens=8), (0,))
    return Sequence(rid + "#0", req, list(tokens))


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Match, allocate the rest of the prompt and mark it computed; returns hit tokens."""
    prefix = kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)
    return prefix.num_tokens


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq(list(range(10)), "a"), make_seq(list(range(5)), "b")
    admit(kv, a)
    admit(kv, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert kv.num_free_blocks == 3
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8
    kv.check_invariants([])


def test_allocation_refused_without_side_effects():
    kv = KVCacheManager(2, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(12)))
    assert not kv.allocate(seq, 12, kv.match_prefix(seq))
    assert seq.block_table == [] and kv.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_only():
    kv = KVCacheManager(16, BS)
    a = make_seq(list(range(10)), "a")
    assert admit(kv, a) == 0
    b = make_seq(list(range(9)) + [99], "b")
    assert admit(kv, b) == 8  # two full blocks; the partial third block is never shared
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert kv.pool.ref_counts[a.block_table[0]] == 2
    kv.check_invariants([a, b])


def test_fully_cached_prompt_leaves_last_block_to_compute():
    kv = KVCacheManager(16, BS)
    a = make_seq(list(range(8)), "a")
    admit(kv, a)
    b = make_seq(list(range(8)), "b")
    assert kv.match_prefix(b).num_tokens == 4


def test_eviction_lru_frees_unreferenced_leaves_first():
    kv = KVCacheManager(4, BS)
    a = make_seq([1] * 8, "a")
    admit(kv, a)
    kv.free(a)
    b = make_seq([2] * 8, "b")
    admit(kv, b)
    kv.free(b)
    assert kv.cache.num_evictable == 4 and kv.pool.num_free == 0
    c = make_seq([3] * 4, "c")
    admit(kv, c)  # evicts one block: the least recently used leaf, a's second block
    assert kv.stats.evictions == 1
    assert kv.match_prefix(make_seq([1] * 8 + [5])).num_tokens == 4
    assert kv.match_prefix(make_seq([2] * 8 + [5])).num_tokens == 8
    kv.check_invariants([c])


def test_copy_on_write_after_fork():
    kv = KVCacheManager(16, BS)
    parent = make_seq(list(range(6)), "p")
    admit(kv, parent)
    child = Sequence("p#1", parent.request, list(parent.token_ids), sample_index=1)
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    parent.token_ids.append(50)
    child.token_ids.append(51)
    assert kv.allocate(parent, 1)  # writes position 6 in the shared partial block -> copy
    copies = kv.take_copies()
    assert copies == [(child.block_table[1], parent.block_table[1])]
    assert kv.allocate(child, 1)  # now the only owner: no copy
    assert kv.take_copies() == []
    assert parent.block_table[0] == child.block_table[0]  # full block still shared
    kv.check_invariants([parent, child])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "free", "evict", "grow"]),
                          st.integers(0, 5), st.integers(1, 14)), min_size=1, max_size=40),
       st.sampled_from(["lru", "lfu"]))
def test_random_operations_keep_invariants(ops, policy):
    """Random admissions (shared prefixes), growth, frees and evictions keep every invariant,
    and once everything ends and the cache is flushed, every block is free."""
    kv = KVCacheManager(12, BS, eviction_policy=policy)
    live: list[Sequence] = []
    prefixes = [[7] * 8, [8] * 4 + [9] * 4, [1, 2, 3, 4]]
    for i, (op, pick, length) in enumerate(ops):
        if op == "admit":
            seq = make_seq((prefixes[pick % 3] + [100 + i] * length)[: max(length, 1)], f"s{i}")
            prefix = kv.match_prefix(seq)
            if kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix):
                seq.num_computed_tokens = seq.num_tokens
                kv.cache_blocks(seq)
                live.append(seq)
        elif op == "grow" and live:
            seq = live[pick % len(live)]
            if kv.allocate(seq, 1):
                seq.token_ids.append(200 + i)
                seq.num_computed_tokens += 1
                kv.cache_blocks(seq)
        elif op == "free" and live:
            kv.free(live.pop(pick % len(live)))
        elif op == "evict" and kv.cache is not None:
            kv.cache.evict(pick)
        kv.check_invariants(live)
        assert kv.num_free_blocks + sum(1 for b in range(kv.num_blocks) if kv.pool.ref_counts[b] > 0) == kv.num_blocks
    for seq in live:
        kv.free(seq)
    kv.reset_prefix_cache()
    kv.check_invariants([])
    assert kv.pool.num_free == kv.num_blocks
