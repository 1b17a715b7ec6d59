"""The step builder copies each block table from its int32 mirror (``BlockTable.ints``); the
tensors must be exactly those of the old builder, which flattened the Python lists
(``bench.block_tables.list_flattening_decode_input``) and, for mixed steps, padded them through
``torch.tensor``. Every comparison reads the peer's tables from plain list copies, so a mirror
out of step with its list after any kind of mutation (growth, padding, copy on write, prefix
dedupe, fork, window placeholders, trim, preemption and re-admission) shows as a difference."""
from __future__ import annotations

import pytest
import torch

from pagoda.bench.block_tables import list_flattening_decode_input, same_inputs
from pagoda.config import SchedulerConfig
from pagoda.executor.input import ModelInput, build_model_input, prepare_model_input
from pagoda.kvcache.block_table import BlockTable
from pagoda.kvcache.manager import WINDOW_PLACEHOLDER, KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import ModelOutput, SchedulerOutput, SeqStepResult
from tests.kvcache.test_kv_manager import make_seq
from tests.scheduler.test_scheduler import fake_results

CPU = torch.device("cpu")
BS = 4


def old_tables(lists: list[list[int]]) -> torch.Tensor:
    """The mixed-step block tables as the old builder made them."""
    width = max(len(t) for t in lists)
    return torch.tensor([t + [0] * (width - len(t)) for t in lists], dtype=torch.int32)


def check_step(sched: SchedulerOutput, counts: dict[str, int]) -> None:
    """``prepare_model_input`` of the step against the old builder's tensors, from list copies."""
    inputs, plan = prepare_model_input(sched, CPU, BS)
    items = sched.scheduled
    lists = [list(item.seq.block_table) for item in items]
    assert torch.equal(inputs.meta.block_tables, old_tables(lists))
    slots = [t[p // BS] * BS + p % BS for item, t in zip(items, lists) for p in range(item.start, item.end)]
    assert inputs.meta.slot_mapping.tolist() == slots
    if all(item.num_new_tokens == 1 for item in items):
        ids = [item.seq.token_ids[item.start] for item in items]
        old = list_flattening_decode_input(ids, [item.end for item in items], lists, plan.rows, CPU, BS)
        assert same_inputs(inputs, old)
        counts["decode"] += 1
    else:
        counts["mixed"] += 1
    counts["padded"] += len({len(t) for t in lists}) > 1


def run_checked(s: Scheduler) -> dict[str, int]:
    """Run ``s`` to the end with a fake model (next token = last + 1), checking every step."""
    counts = {"decode": 0, "mixed": 0, "padded": 0}
    while s.has_unfinished():
        out = s.schedule()
        if out.scheduled:
            check_step(out, counts)
        s.update(out, fake_results(out))
    return counts


def scheduler(kv: KVCacheManager, budget: int = 24) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=True, long_prefill_token_threshold=0, policy="fcfs")
    return Scheduler(cfg, kv)


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> None:
    s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True), (0,)))


def test_a_run_with_forks_dedupe_and_preemption_builds_the_old_tensors_every_step():
    kv = KVCacheManager(14, BS)  # tight: sequences are preempted and admitted again
    s = scheduler(kv)
    add(s, "same-a", list(range(9)), 12)  # identical prompts computed side by side: the second's
    add(s, "same-b", list(range(9)), 12)  # blocks are replaced by the first's when cached
    add(s, "forked", list(range(100, 106)), 10, n=2)  # samples share the partial block: copy on write
    add(s, "long", list(range(200, 230)), 6)  # chunked, and the widest table: others are padded
    copies, deduped = [], []
    take, insert = kv.take_copies, kv.cache.insert
    kv.take_copies = lambda: copies.extend(take()) or []  # (recorded; the fake model copies nothing)

    def recording_insert(parent, key, block, namespace):
        node = insert(parent, key, block, namespace)
        deduped.append(node.block != block)
        return node

    kv.cache.insert = recording_insert
    counts = run_checked(s)
    assert s.num_preemptions > 0 and copies and any(deduped)
    assert counts["decode"] and counts["mixed"] and counts["padded"]


def test_window_placeholders_build_the_old_tensors():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False, sliding_window=6)
    s = scheduler(kv)
    add(s, "a", list(range(10)), 30)
    add(s, "b", list(range(50, 53)), 20)
    seqs = [v[0] for v in s.requests.values()]
    seen_placeholder = False
    counts = {"decode": 0, "mixed": 0, "padded": 0}
    while s.has_unfinished():
        out = s.schedule()
        check_step(out, counts)
        seen_placeholder |= any(seq.num_window_released and seq.block_table[0] == WINDOW_PLACEHOLDER
                                for seq in seqs)
        s.update(out, ModelOutput({item.seq.seq_id: SeqStepResult([7]) for item in out.scheduled if item.samples}))
    assert seen_placeholder and counts["decode"]


def decode_both(tables: list[BlockTable]) -> tuple[ModelInput, ModelInput]:
    """One decode step of ``tables`` (each sequence at its last block's last slot): the builder's
    inputs from the mirrors and the old builder's from list copies."""
    n = len(tables)
    seq_lens = [BS * len(t) for t in tables]
    ids, rows = list(range(10, 10 + n)), list(range(n))
    new = build_model_input(ids, [1] * n, seq_lens, tables, rows, CPU, BS)
    old = list_flattening_decode_input(ids, seq_lens, [list(t) for t in tables], rows, CPU, BS)
    return new, old


def test_trim_free_and_readmission_build_the_old_tensors():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False)
    a, b = make_seq(list(range(30)), "a"), make_seq(list(range(9)), "b")
    assert kv.allocate(a, 30) and kv.allocate(b, 9)
    assert same_inputs(*decode_both([a.block_table, b.block_table]))
    kv.trim(a, 17)  # speculative rollback pops blocks
    assert same_inputs(*decode_both([a.block_table, b.block_table]))
    kv.free(a)  # preemption, then admission again (new blocks, a new table)
    assert kv.allocate(b, 12) and kv.allocate(a, 21)
    assert same_inputs(*decode_both([b.block_table, a.block_table]))


def test_a_mirror_out_of_step_would_be_seen():
    table = BlockTable([3, 4, 5])
    other = BlockTable([6])
    assert same_inputs(*decode_both([table, other]))
    table.ints[1] = 9  # what a mutation that forgot the mirror would leave
    assert not same_inputs(*decode_both([table, other]))
    table.ints[1] = 4
    list.append(other, 8)  # a list-only append: the mirror is a row short, and the step fails
    with pytest.raises(RuntimeError, match="split"):
        decode_both([table, other])


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
def test_plain_lists_and_block_tables_give_the_same_inputs(decode):
    """Callers that lay out their own batch (the memory profile's dummy step, the attention
    benchmarks) pass lists; they take the same path through ``array``."""
    lists = [[3, 4], [7], [9, 10, 11]]
    q_lens = [1, 1, 1] if decode else [3, 1, 2]
    seq_lens = [8, 4, 12]
    ids = list(range(sum(q_lens)))
    a = build_model_input(ids, q_lens, seq_lens, lists, [0, 1, 2], CPU, BS)
    b = build_model_input(ids, q_lens, seq_lens, [BlockTable(t) for t in lists], [0, 1, 2], CPU, BS)
    assert same_inputs(a, b)
    assert torch.equal(b.meta.block_tables, old_tables(lists))
