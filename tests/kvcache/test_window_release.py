"""Sliding window: blocks no future token can attend to are given back as a sequence advances
(prefix caching off), with placeholders keeping positions in the block table; with prefix caching
on they are kept (the radix tree evicts leaves first, see kvcache/manager.py)."""
from __future__ import annotations

from pagoda.kvcache.manager import WINDOW_PLACEHOLDER, KVCacheManager
from tests.kvcache.test_kv_manager import BS, make_seq


def advance(kv: KVCacheManager, seq, n: int) -> None:
    """Compute ``n`` more tokens of ``seq`` (allocating first), then release what fell out."""
    assert kv.allocate(seq, n)
    seq.num_computed_tokens += n
    kv.release_outside_window(seq)


def test_blocks_behind_the_window_are_released_and_positions_kept():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, sliding_window=6)
    seq = make_seq(list(range(40)))
    advance(kv, seq, 10)  # tokens 0..9; the next one (10) sees 5..10: block 0 (0..3) is out
    assert seq.block_table == [WINDOW_PLACEHOLDER, 1, 2] and seq.num_window_released == 1
    assert kv.num_free_blocks == 14  # block 0 back in the pool
    kv.check_invariants([seq])
    advance(kv, seq, 13)  # 23 computed: token 23 sees 18..23, blocks 0..3 (0..15) are out
    assert seq.num_window_released == 4 and len(seq.block_table) == 6
    assert seq.block_table[4:] == [4, 5] and kv.num_used_blocks == 2
    kv.check_invariants([seq])
    kv.free(seq)
    assert kv.num_free_blocks == 16 and seq.num_window_released == 0
    kv.check_invariants([])


def test_a_long_sequence_holds_a_bounded_number_of_blocks():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, sliding_window=6)
    seq = make_seq([1, 2, 3])
    advance(kv, seq, 3)
    peak = 0
    for _ in range(200):  # 203 tokens would need 51 blocks; the pool has 8
        advance(kv, seq, 1)
        peak = max(peak, kv.num_used_blocks)
        kv.check_invariants([seq])
    assert peak <= 3  # the window (6) spans at most 3 blocks of 4, plus the one being written
    assert len(seq.block_table) == 51


def test_forked_samples_each_release_their_own_reference():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, sliding_window=4)
    parent, child = make_seq(list(range(12)), "p"), make_seq(list(range(12)), "c")
    advance(kv, parent, 12)  # 12 computed: token 12 sees 9..12, blocks 0 and 1 are out
    assert parent.num_window_released == 2
    kv.fork(parent, child)
    assert child.num_window_released == 2 and kv.num_used_blocks == 1
    advance(kv, child, 4)
    kv.check_invariants([parent, child])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 16
    kv.check_invariants([])


def test_prefix_caching_keeps_every_block():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True, sliding_window=6)
    assert kv.sliding_window is None
    seq = make_seq(list(range(24)))
    advance(kv, seq, 24)
    assert seq.num_window_released == 0 and kv.num_used_blocks == 6
