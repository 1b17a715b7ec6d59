"""The recurrent-state slots a hybrid model's KV-cache manager keeps beside the blocks, with no
model: a slot per running sequence, taken with its blocks, given back with them, copied on
forks; exhaustion refuses like a lack of blocks; no prefix reuse."""
from __future__ import annotations

import pytest

from pagoda.kvcache.manager import KVCacheManager
from pagoda.kvcache.state_pool import StatePool
from tests.kvcache.test_kv_manager import BS, make_seq


def test_slot_taken_on_admission_and_kept_while_running():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, num_state_slots=3)
    a, b = make_seq(list(range(10)), "a"), make_seq(list(range(5)), "b")
    assert kv.allocate(a, 10) and kv.allocate(b, 5)
    assert (a.state_slot, b.state_slot) == (0, 1)
    a.num_computed_tokens = 10
    assert kv.allocate(a, 1)  # a decode step: more blocks maybe, the same slot
    assert a.state_slot == 0 and kv.states.num_free == 1
    kv.check_invariants([a, b])
    kv.free(a)
    assert a.state_slot is None and kv.states.num_free == 2
    kv.check_invariants([b])


def test_no_free_slot_refuses_and_changes_nothing():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, num_state_slots=1)
    a, b = make_seq(list(range(6)), "a"), make_seq(list(range(6)), "b")
    assert kv.allocate(a, 6)
    free_blocks = kv.num_free_blocks
    assert not kv.allocate(b, 6)
    assert b.block_table == [] and b.state_slot is None and kv.num_free_blocks == free_blocks
    kv.free(a)  # preemption or finish gives the slot back; b can start (from a zero state)
    assert kv.allocate(b, 6) and b.state_slot == 0
    kv.check_invariants([b])


def test_short_blocks_take_no_slot():
    kv = KVCacheManager(2, BS, enable_prefix_caching=False, num_state_slots=4)
    a = make_seq(list(range(20)), "a")
    assert not kv.allocate(a, 20)
    assert a.state_slot is None and kv.states.num_free == 4


def test_fork_gives_each_sample_a_slot_and_queues_a_copy():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, num_state_slots=3)
    parent = make_seq(list(range(7)), "p")
    assert kv.allocate(parent, 7)
    parent.num_computed_tokens = 7
    c1, c2 = make_seq(list(range(7)), "p1"), make_seq(list(range(7)), "p2")
    kv.fork(parent, c1)
    kv.fork(parent, c2)
    assert {parent.state_slot, c1.state_slot, c2.state_slot} == {0, 1, 2}
    assert kv.take_state_copies() == [(parent.state_slot, c1.state_slot), (parent.state_slot, c2.state_slot)]
    assert kv.take_state_copies() == []
    kv.check_invariants([parent, c1, c2])
    with pytest.raises(RuntimeError, match="no free recurrent-state slot"):
        kv.fork(parent, make_seq(list(range(7)), "p3"))


def test_hybrid_manager_matches_no_prefix():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True, num_state_slots=2)
    a = make_seq(list(range(12)), "a")
    assert kv.allocate(a, 12)
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    kv.free(a)
    again = make_seq(list(range(12)), "b")
    assert kv.match_prefix(again).num_tokens == 0


def test_pool_rejects_double_release_and_empty_pool():
    pool = StatePool(2)
    slot = pool.allocate()
    pool.release(slot)
    with pytest.raises(AssertionError):
        pool.release(slot)
    with pytest.raises(ValueError):
        StatePool(0)
