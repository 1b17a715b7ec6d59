"""The priority policy and deadlines (scheduler/priority.py) with the fake model of test_scheduler."""
from __future__ import annotations

import time

from pagoda.config import SchedulerConfig
from pagoda.engine.core import _failure
from pagoda.kvcache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.priority import QUEUE_TIMEOUT_PREFIX, TIMEOUT_FINISH_REASON, Deadlines
from pagoda.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import fake_step, run_all


def make(policy="priority", num_blocks=64, budget=64, max_seqs=8, block=4, max_queue_time=None):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=True, long_prefill_token_threshold=0, policy=policy,
                          max_queue_time=max_queue_time)
    return Scheduler(cfg, KVCacheManager(num_blocks, block, enable_prefix_caching=False))


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int, priority: int = 0, start: int = 0,
        n: int = 1, arrival: float | None = None, deadline: float | None = None) -> Request:
    request = Request(rid, list(range(start, start + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True), (0,), priority=priority,
                      deadline=deadline, **({"arrival_time": arrival} if arrival is not None else {}))
    s.add_request(request)
    return request


def admitted(out) -> list[str]:
    return [item.seq.request_id for item in out.scheduled]


def test_waiting_queue_runs_lower_priority_values_first_then_arrival():
    s = make(max_seqs=1)
    add(s, "late-batch", 4, 1, priority=10, arrival=1.0)
    add(s, "p5", 4, 1, priority=5, arrival=2.0, start=100)
    add(s, "p0-a", 4, 1, priority=0, arrival=3.0, start=200)
    add(s, "p0-b", 4, 1, priority=0, arrival=4.0, start=300)
    add(s, "urgent", 4, 1, priority=-1, arrival=5.0, start=400)
    assert [q.request_id for q in s.waiting] == ["urgent", "p0-a", "p0-b", "p5", "late-batch"]
    order = []
    for out in run_all(s):
        order += [rid for rid in admitted(out) if rid not in order]
    assert order == ["urgent", "p0-a", "p0-b", "p5", "late-batch"]


def test_fcfs_keeps_arrival_order_whatever_the_priority():
    s = make(policy="fcfs", max_seqs=1)
    add(s, "a", 4, 1, priority=10)
    add(s, "b", 4, 1, priority=0, start=100)
    assert [q.request_id for q in s.waiting] == ["a", "b"]


def test_higher_priority_preempts_the_lowest_priority_running_when_the_batch_is_full():
    s = make(max_seqs=2)
    add(s, "low-old", 4, 50, priority=5)
    add(s, "low-new", 4, 50, priority=5, start=100)
    fake_step(s)
    assert sorted(q.request_id for q in s.running) == ["low-new", "low-old"]
    add(s, "high", 4, 3, priority=0, start=200)
    out = fake_step(s)
    assert "high" in admitted(out)
    assert [q.request_id for q in out.preempted] == ["low-new"]  # the newest of the lowest class
    assert s.waiting[0].request_id == "low-new" and s.waiting[0].num_computed_tokens == 0
    run_all(s)
    s.kv.check_invariants([])


def test_equal_priority_never_preempts_and_fcfs_never_preempts_for_priority():
    for policy, priority in (("priority", 5), ("fcfs", 0)):
        s = make(policy=policy, max_seqs=2)
        add(s, "a", 4, 50, priority=5)
        add(s, "b", 4, 50, priority=5, start=100)
        fake_step(s)
        add(s, "c", 4, 3, priority=priority if policy == "priority" else 0, start=200)
        out = fake_step(s)
        assert out.preempted == [] and "c" not in admitted(out)


def test_higher_priority_preempts_lower_for_kv_blocks():
    # 6 blocks of 4 tokens: the low-priority request's 16-token prompt holds 4 of them, the
    # urgent one's 12-token prompt needs 3.
    s = make(num_blocks=6, max_seqs=8)
    add(s, "low", 16, 8, priority=3)
    fake_step(s)
    add(s, "high", 12, 2, priority=0, start=500)
    out = fake_step(s)
    assert "high" in admitted(out) and [q.request_id for q in out.preempted] == ["low"]
    steps = run_all(s)
    # The preempted request ran again once the urgent one was done, to its full length.
    assert any("low" in admitted(o) for o in steps)
    s.kv.check_invariants([])


def test_running_sequence_short_of_a_block_preempts_the_lowest_priority_not_the_newest():
    s = make(num_blocks=4, max_seqs=8)
    add(s, "low", 4, 40, priority=9)
    add(s, "high", 4, 40, priority=0, start=100)
    preempted = []
    while not preempted:
        out = fake_step(s)
        preempted = [q.request_id for q in out.preempted]
    assert preempted == ["low"]


def test_queue_time_limit_fails_a_request_that_never_started_with_a_503():
    s = make(max_seqs=1, max_queue_time=0.05)
    add(s, "running", 4, 200, priority=0)
    fake_step(s)
    waiting = add(s, "waits", 4, 2, priority=0, start=100)
    time.sleep(0.08)
    fake_step(s)
    failed = s.take_failed()
    assert set(failed) == {"waits"} and failed["waits"].startswith(QUEUE_TIMEOUT_PREFIX)
    assert "waits" not in s.requests and not s.waiting
    assert waiting.metrics.first_scheduled_time is None
    error = _failure("waits", failed["waits"])
    assert error.status == 503 and "max_queue_time" in error.message
    # The running request, which started before its limit, is not touched.
    assert [q.request_id for q in s.running] == ["running"]
    run_all(s)


def test_own_deadline_ends_a_running_request_with_finish_reason_timeout():
    s = make()
    add(s, "short-lived", 4, 10_000, deadline=time.time() + 0.05, n=2)
    add(s, "other", 4, 20, start=100)
    fake_step(s)  # both start; short-lived forks into its 2 samples after its prompt
    time.sleep(0.08)
    fake_step(s)
    ended = s.take_ended()
    assert sorted(seq.seq_id for seq, _ in ended) == ["short-lived#0", "short-lived#1"]
    assert all(seq.finish_reason == TIMEOUT_FINISH_REASON for seq, _ in ended)
    assert "short-lived" not in s.requests and s.take_failed() == {}
    steps = run_all(s)
    assert all("short-lived" not in admitted(o) for o in steps)
    s.kv.check_invariants([])


def test_deadline_of_a_prompt_not_yet_forked_ends_all_its_samples():
    s = make(budget=4)
    add(s, "forks", 12, 5, n=3, deadline=time.time() + 0.05)
    fake_step(s)  # the first 4 of 12 prompt tokens: not forked yet
    time.sleep(0.08)
    fake_step(s)
    ended = s.take_ended()
    assert [(seq.seq_id, samples) for seq, samples in ended] == [("forks#0", 3)]
    assert not s.has_unfinished() and "forks" not in s.requests
    s.kv.check_invariants([])


def test_deadline_of_a_waiting_request_is_a_503_like_the_queue_limit():
    s = make(max_seqs=1)
    add(s, "running", 4, 200)
    fake_step(s)
    add(s, "waits", 4, 2, start=100, deadline=time.time() + 0.03)
    time.sleep(0.05)
    fake_step(s)
    failed = s.take_failed()
    assert list(failed) == ["waits"] and "timeout" in failed["waits"]


def test_deadlines_hold_requests_weakly_and_in_time_order():
    d = Deadlines()
    r1 = Request("a", [1], SamplingParams(), (0,))
    r2 = Request("b", [1], SamplingParams(), (0,))
    d.add(5.0, "end", r1)
    d.add(1.0, "queue", r2)
    d.add(3.0, "queue", Request("gone", [1], SamplingParams(), (0,)))  # dropped at once
    assert d.due(0.5) == []
    assert [(k, r.request_id) for k, r in d.due(10.0)] == [("queue", "b"), ("end", "a")]
    assert not d
