"""The background (batch) class (scheduler/background.py) with the fake model of test_scheduler:
background rows run only in steps with no interactive request, keep their state while paused,
are preempted first, and never keep an interactive request from starting."""
from __future__ import annotations

import pytest

from pagoda.config import SchedulerConfig
from pagoda.kvcache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import fake_step

POLICIES = ("fcfs", "priority")


def make(policy="fcfs", num_blocks=64, budget=64, max_seqs=8, block=4, prefix=False):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=True, long_prefill_token_threshold=0, policy=policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, block, enable_prefix_caching=prefix))


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int, background=False, start=0, tenant="default",
        n=1) -> Request:
    request = Request(rid, list(range(start, start + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n), (0,), background=background,
                      tenant=tenant)
    s.add_request(request)
    return request


def step_ids(out) -> set[str]:
    return {item.seq.request_id for item in out.scheduled}


def drive(s: Scheduler, background: set[str], limit=2000) -> tuple[list, dict[str, list[int]]]:
    """Run ``s`` to the end, checking every step: a step holds no background row while an
    interactive request was unfinished before it, and never more rows than max_num_seqs.
    Returns the steps and each request's tokens."""
    steps, tokens = [], {}
    seqs = {rid: seq for rid, seqs in s.requests.items() for seq in seqs}
    while s.has_unfinished() and len(steps) < limit:
        interactive = any(rid not in background for rid in s.requests)
        seqs.update({rid: seq for rid, seqs in s.requests.items() for seq in seqs})
        out = fake_step(s)
        ids = step_ids(out)
        if interactive:
            assert not ids & background, f"step {len(steps)} ran background rows {ids & background}"
        assert len(out.scheduled) <= s.config.max_num_seqs
        assert sum(x.num_samples for x in s.running) <= s.config.max_num_seqs
        steps.append(out)
    assert not s.has_unfinished()
    s.kv.check_invariants([])
    for rid, seq in seqs.items():
        tokens[rid] = list(seq.token_ids)
    return steps, tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_no_step_holds_a_background_row_while_interactive_work_is_in_the_engine(policy):
    s = make(policy)
    for i in range(3):
        add(s, f"b{i}", 6, 30, background=True, start=100 * i)
    for _ in range(3):
        assert step_ids(fake_step(s)) == {"b0", "b1", "b2"}  # alone, the batch runs
    add(s, "i0", 5, 8, start=500)
    add(s, "i1", 5, 12, start=600)
    steps, _ = drive(s, {"b0", "b1", "b2"})
    ran = [step_ids(o) for o in steps]
    first_batch_again = next(k for k, ids in enumerate(ran) if ids & {"b0", "b1", "b2"})
    assert all(ids <= {"i0", "i1"} for ids in ran[:first_batch_again])
    assert "i1" in ran[first_batch_again - 1]  # they resumed only once the interactive ones were done
    assert s.num_preemptions == 0  # with room for all, paused rows kept their blocks


def test_a_background_request_waiting_is_not_admitted_beside_interactive_work():
    s = make(max_seqs=8)
    add(s, "i0", 4, 10)
    fake_step(s)
    add(s, "b0", 4, 5, background=True, start=100)
    for _ in range(9):
        assert step_ids(fake_step(s)) == {"i0"}
    assert s.waiting[0].request_id == "b0"
    assert step_ids(fake_step(s)) == {"b0"}  # i0 finished at the step before


@pytest.mark.parametrize("policy", POLICIES)
def test_paused_rows_resume_with_the_tokens_they_would_have_had_alone(policy):
    alone = make(policy)
    for i in range(3):
        add(alone, f"b{i}", 7, 25, background=True, start=100 * i)
    _, expected = drive(alone, {"b0", "b1", "b2"})
    mixed = make(policy, num_blocks=40, max_seqs=4)  # tight: some paused rows are preempted too
    for i in range(3):
        add(mixed, f"b{i}", 7, 25, background=True, start=100 * i)
    background = {"b0", "b1", "b2"}
    for k in range(30):
        if k % 6 == 2:  # interactive requests come and go while the batch runs
            add(mixed, f"i{k}", 9, 7, start=1000 + 50 * k)
        if mixed.has_unfinished():
            interactive = any(rid not in background for rid in mixed.requests)
            out = fake_step(mixed)
            assert not (interactive and step_ids(out) & background)
    _, got = drive(mixed, background)
    assert {rid: got[rid] for rid in background} == expected


@pytest.mark.parametrize("policy", POLICIES)
def test_kv_pressure_preempts_background_rows_before_any_interactive_one(policy):
    s = make(policy, num_blocks=12, block=4, max_seqs=8)
    add(s, "b0", 8, 40, background=True)
    add(s, "b1", 8, 40, background=True, start=100)
    for _ in range(6):
        fake_step(s)  # the batch rows hold 2 x 4 blocks
    add(s, "i0", 8, 20, start=500)
    add(s, "i1", 8, 20, start=600)
    preempted_order = []
    steps, tokens = drive(s, {"b0", "b1"})
    for out in steps:
        preempted_order += [q.request_id for q in out.preempted]
    assert preempted_order, "the pool is too small for all four: someone must be preempted"
    first_interactive = next((k for k, r in enumerate(preempted_order) if r.startswith("i")), len(preempted_order))
    assert set(preempted_order[:first_interactive]) == {"b0", "b1"}  # both batch rows went first
    assert tokens["i0"][8:] == list(range(508, 528)) and tokens["i1"][8:] == list(range(608, 628))


@pytest.mark.parametrize("policy", POLICIES)
def test_paused_rows_never_keep_an_interactive_request_from_its_seat(policy):
    s = make(policy, max_seqs=3, num_blocks=64)
    for i in range(3):
        add(s, f"b{i}", 4, 50, background=True, start=100 * i)
    fake_step(s)
    assert len(s.running) == 3  # every seat is a batch row's
    add(s, "i0", 4, 5, start=500)
    add(s, "i1", 4, 5, start=600, n=2)  # a prompt still to fork takes its two seats
    out = fake_step(s)
    assert step_ids(out) == {"i0", "i1"}  # both start at once
    assert sorted(q.request_id for q in out.preempted) == ["b0", "b1", "b2"]
    assert sum(q.num_samples for q in s.running) <= 3
    drive(s, {"b0", "b1", "b2"})


def test_interactive_admission_goes_on_when_paused_rows_give_back_seats_under_tenants():
    s = make(max_seqs=2, num_blocks=64)
    add(s, "b0", 4, 50, background=True, tenant="batch-owner")
    add(s, "b1", 4, 50, background=True, tenant="batch-owner", start=100)
    fake_step(s)
    add(s, "i0", 4, 5, start=500, tenant="alice")
    out = fake_step(s)
    assert step_ids(out) == {"i0"}
    assert [q.request_id for q in out.preempted] == ["b1"]  # one seat was enough
    drive(s, {"b0", "b1"})


def test_abort_of_a_paused_row_and_the_background_count():
    s = make()
    add(s, "b0", 4, 50, background=True)
    add(s, "b1", 4, 50, background=True, start=100)
    fake_step(s)
    add(s, "i0", 4, 5, start=500)
    fake_step(s)
    s.abort_request("b0")
    assert s.num_background == 1
    drive(s, {"b1"})
    assert s.num_background == 0 and not s.requests


def test_background_holdoff_keeps_the_batch_paused_after_interactive_work_ends(monkeypatch):
    """``background_holdoff``: once the last interactive request leaves, background rows (running
    or waiting) stay out of the steps for that long, then run on; with 0 they resume at once."""
    import pagoda.scheduler.scheduler as sched_mod

    clock = [1000.0]
    monkeypatch.setattr(sched_mod.time, "monotonic", lambda: clock[0])
    s = make()
    s.background_holdoff = 0.05
    add(s, "b0", 6, 40, background=True)
    assert step_ids(fake_step(s)) == {"b0"} and s.background_held_for() == 0  # no interactive work yet
    add(s, "i0", 4, 2, start=300)
    add(s, "b1", 5, 10, background=True, start=200)  # waiting background work is held too
    while "i0" in s.requests:
        assert "b0" not in step_ids(fake_step(s))
    assert s.background_held_for() == pytest.approx(0.05)
    for _ in range(3):
        assert step_ids(fake_step(s)) == set()
    clock[0] += 0.03
    assert s.background_held_for() == pytest.approx(0.02) and step_ids(fake_step(s)) == set()
    clock[0] += 0.021
    assert s.background_held_for() == 0 and step_ids(fake_step(s)) == {"b0", "b1"}
    s.background_holdoff = 0.0
    add(s, "i1", 4, 2, start=400)
    while "i1" in s.requests:
        fake_step(s)
    assert s.background_held_for() == 0 and step_ids(fake_step(s)) == {"b0", "b1"}
