"""``BlockTable``: a list for every reader, its int32 mirror (``ints``, what the step builder
copies) in step after every kind of mutation, alone and as the KV manager drives it."""
from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings, strategies as st

from pagoda.kvcache.block_table import BlockTable
from pagoda.kvcache.manager import WINDOW_PLACEHOLDER, KVCacheManager
from pagoda.request import Sequence
from tests.kvcache.test_kv_manager import BS, admit, make_seq


def mirrored(table: BlockTable) -> list[int]:
    """The table's ids, after checking its mirror holds exactly them."""
    assert type(table) is BlockTable
    assert table.ints.tolist() == list(table), f"mirror {table.ints.tolist()} != table {list(table)}"
    return list(table)


MUTATIONS = {
    "append": lambda t: t.append(70),
    "setitem": lambda t: t.__setitem__(1, 71),
    "setitem_negative": lambda t: t.__setitem__(-1, 72),
    "setitem_slice": lambda t: t.__setitem__(slice(1, 3), [73, 74, 75]),
    "pop": lambda t: t.pop(),
    "pop_front": lambda t: t.pop(0),
    "extend": lambda t: t.extend(iter([76, 77])),
    "iadd": lambda t: t.__iadd__([78]),
    "insert": lambda t: t.insert(1, 79),
    "delitem": lambda t: t.__delitem__(0),
    "delitem_slice": lambda t: t.__delitem__(slice(None, None, 2)),
    "remove": lambda t: t.remove(12),
    "sort": lambda t: t.sort(reverse=True),
    "reverse": lambda t: t.reverse(),
    "imul": lambda t: t.__imul__(2),
    "clear": lambda t: t.clear(),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_matches_a_list_and_keeps_the_mirror(name):
    table, model = BlockTable([10, 11, 12, 13]), [10, 11, 12, 13]
    got, want = MUTATIONS[name](table), MUTATIONS[name](model)
    assert mirrored(table) == model and table == model
    assert (got is table) if name in ("iadd", "imul") else got == want


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=30))
def test_any_run_of_mutations_keeps_the_mirror(names):
    table, model = BlockTable([10, 11, 12, 13]), [10, 11, 12, 13]
    for name in names:
        if name != "append" and len(model) < 4:  # (the index-taking ones need a few entries)
            table.extend([10, 11, 12, 13])
            model.extend([10, 11, 12, 13])
        if name == "remove" and 12 not in model:
            continue
        MUTATIONS[name](table)
        MUTATIONS[name](model)
        assert mirrored(table) == model


def test_it_reads_as_the_list_it_replaces():
    table = BlockTable([3, 4, 5])
    assert table == [3, 4, 5] and [3, 4, 5] == table and table != [3, 4]
    assert table[1:] == [4, 5] and type(table[1:]) is list and table[-1] == 5
    assert list(table) == [3, 4, 5] and len(table) == 3 and 4 in table
    assert repr(table) == "[3, 4, 5]" and table + [0] == [3, 4, 5, 0]


def test_copies_are_independent_and_survive_pickling():
    table = BlockTable([1, 2, 3])
    for other in (table.copy(), copy.copy(table), copy.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert mirrored(other) == [1, 2, 3] and other.ints is not table.ints
        other.append(9)
        other[0] = 8
        assert mirrored(table) == [1, 2, 3]


def test_an_id_int32_cannot_hold_changes_nothing():
    table = BlockTable([1, 2])
    for bad in (lambda: table.append(2**31), lambda: table.__setitem__(0, -2**31 - 1),
                lambda: table.insert(0, 2**40), lambda: table.extend([5, 2**33])):
        with pytest.raises(OverflowError):
            bad()
        assert mirrored(table) == [1, 2]


def test_holders_start_with_a_block_table_and_keep_it_through_iadd():
    from pagoda.spec_decode.draft_model import DraftState

    seq = make_seq([1, 2, 3])
    assert mirrored(seq.block_table) == [] and mirrored(DraftState(seq).block_table) == []
    same = seq.block_table
    seq.block_table += [7]
    assert seq.block_table is same and mirrored(seq.block_table) == [7]


def test_check_invariants_refuses_a_plain_list_or_a_stale_mirror():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(6)))
    assert kv.allocate(seq, 6)
    kv.check_invariants([seq])
    seq.block_table.ints[0] = 7  # what a mutation that forgot the mirror would leave
    with pytest.raises(AssertionError, match="mirror"):
        kv.check_invariants([seq])
    seq.block_table = [0, 1]
    with pytest.raises(AssertionError, match="is a <class 'list'>"):
        kv.check_invariants([seq])


# ---- the KV manager's mutations -------------------------------------------------------------

def test_allocation_and_growth_append_to_both():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    admit(kv, seq)
    assert mirrored(seq.block_table) == [0, 1, 2]
    seq.token_ids.extend([1, 2, 3])
    assert kv.allocate(seq, 3)
    assert mirrored(seq.block_table) == [0, 1, 2, 3]


def test_copy_on_write_and_fork_keep_each_mirror():
    kv = KVCacheManager(16, BS)
    parent = make_seq(list(range(6)), "p")
    admit(kv, parent)
    child = Sequence("p#1", parent.request, list(parent.token_ids), sample_index=1)
    kv.fork(parent, child)
    assert mirrored(child.block_table) == mirrored(parent.block_table)
    assert child.block_table is not parent.block_table and child.block_table.ints is not parent.block_table.ints
    parent.token_ids.append(50)
    assert kv.allocate(parent, 1)  # the shared partial block is copied: an item assignment
    (src, dst), = kv.take_copies()
    assert mirrored(parent.block_table)[1] == dst and mirrored(child.block_table)[1] == src
    kv.check_invariants([parent, child])


def test_prefix_cache_dedupe_replaces_the_entry_in_both():
    kv = KVCacheManager(16, BS)
    a, b = make_seq(list(range(8)), "a"), make_seq(list(range(8)), "b")
    for seq in (a, b):  # both compute the same blocks before either is cached
        assert kv.allocate(seq, 8, kv.match_prefix(seq))
        seq.num_computed_tokens = 8
    kv.cache_blocks(a)
    kv.cache_blocks(b)  # b's blocks are the same content: b now shares a's
    assert mirrored(b.block_table) == mirrored(a.block_table)
    kv.check_invariants([a, b])


def test_window_placeholders_trim_free_and_readmission():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, sliding_window=6)
    seq = make_seq(list(range(40)))
    assert kv.allocate(seq, 14)
    seq.num_computed_tokens = 14
    kv.release_outside_window(seq)
    assert mirrored(seq.block_table) == [WINDOW_PLACEHOLDER, WINDOW_PLACEHOLDER, 2, 3]
    kv.trim(seq, 9)  # speculative rollback: pops
    assert mirrored(seq.block_table) == [WINDOW_PLACEHOLDER, WINDOW_PLACEHOLDER, 2]
    kv.free(seq)  # preemption
    assert mirrored(seq.block_table) == []
    seq.num_computed_tokens = 0
    assert kv.allocate(seq, 10)  # re-admission
    assert len(set(mirrored(seq.block_table))) == 3 and kv.num_used_blocks == 3
    kv.check_invariants([seq])
