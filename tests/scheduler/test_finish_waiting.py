"""Ending a sample from outside the token checks (a stop string) while it is preempted and
waiting to be recomputed, and failing a request alone."""
from __future__ import annotations

from pagoda.request import SeqStatus
from pagoda.step import ModelOutput, SeqStepResult

from tests.scheduler.test_scheduler import add, fake_step, make_scheduler, run_all


def preempt_one(s):
    """Two requests grow until the pool runs dry and the newer one is preempted."""
    add(s, "old", 8, 12)
    add(s, "new", 8, 12, start=100)
    for _ in range(100):
        fake_step(s)
        if s.num_preemptions:
            break
    (waiting,) = list(s.waiting)
    assert waiting.status == SeqStatus.WAITING and waiting.request_id == "new"
    return waiting


def test_stop_string_ends_a_preempted_waiting_sample():
    s = make_scheduler(num_blocks=6, budget=64, block=4, prefix=False)
    waiting = preempt_one(s)
    s.finish_sequence(waiting, "stop", "the end")
    assert waiting.finished and (waiting.finish_reason, waiting.stop_reason) == ("stop", "the end")
    assert waiting not in s.waiting and "new" not in s.requests
    assert waiting.block_table == []
    run_all(s)  # the other request completes; nothing is left behind
    assert s.kv.num_used_blocks == 0
    s.kv.check_invariants([])


def test_fail_request_frees_everything_and_is_reported_once():
    s = make_scheduler(num_blocks=64, budget=64, block=4)
    add(s, "ok", 6, 5)
    add(s, "bad", 9, 5, n=3, start=50)
    fake_step(s)  # both prompts done; "bad" forked into 3 samples sharing blocks
    assert len(s.requests["bad"]) == 3
    s.fail_request(s.requests["bad"][0].request, "RuntimeError: boom")
    assert s.take_failed() == {"bad": "RuntimeError: boom"} and s.take_failed() == {}
    assert "bad" not in s.requests and all(q.request_id == "ok" for q in s.running)
    s.kv.check_invariants(s.running)
    run_all(s)
    assert s.kv.num_used_blocks == 0


def test_update_failure_of_one_sequence_spares_the_rest():
    s = make_scheduler(num_blocks=64, budget=64, block=4)
    add(s, "ok", 6, 3)
    add(s, "bad", 6, 3, start=50)
    bad = s.requests["bad"][0]
    bad.request.params.max_tokens = "3"  # the stop check raises TypeError for this one only
    out = s.schedule()
    results = ModelOutput({item.seq.seq_id: SeqStepResult([7]) for item in out.scheduled})
    updates = s.update(out, results)
    assert [u.seq.request_id for u in updates] == ["ok"] and updates[0].new_token_ids == [7]
    assert set(s.take_failed()) == {"bad"} and bad.finish_reason == "error"
    run_all(s)
    assert s.kv.num_used_blocks == 0
