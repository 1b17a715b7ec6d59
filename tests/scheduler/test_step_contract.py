"""What the scheduler hands the executor beyond tokens: proposals in ``ScheduledSeq.draft``
(only where the budget holds them all) and the ids of requests that left the engine."""
from __future__ import annotations

from test_scheduler import add, fake_step, make_scheduler

from pagoda.step import Draft, ModelOutput, SeqStepResult


def _decoding(s, rid="a"):
    add(s, rid, 4, 20)
    fake_step(s)  # the prompt ran: the sequence now decodes one token per step
    [seq] = s.requests[rid]
    return seq


def test_a_draft_rides_in_the_scheduled_sequence():
    s = make_scheduler(budget=16)
    seq = _decoding(s)
    draft = Draft([7, 8, 9])
    out = s.schedule({seq.seq_id: draft})
    [item] = out.scheduled
    assert item.draft is draft and item.num_draft_tokens == 3 and item.num_new_tokens == 4
    assert item.start == seq.num_computed_tokens and item.samples
    # Two drafts accepted: the sequence keeps them plus the target's token.
    s.update(out, ModelOutput({seq.seq_id: SeqStepResult([7, 8, 42], num_draft_accepted=2)}))
    assert seq.token_ids[-3:] == [7, 8, 42] and seq.num_computed_tokens == seq.num_tokens - 1
    # Nothing stays on the sequence: the next step runs without a draft unless given one.
    assert s.schedule().scheduled[0].draft is None


def test_a_draft_the_budget_cannot_hold_is_dropped():
    s = make_scheduler(budget=3)
    seq = _decoding(s)
    [item] = s.schedule({seq.seq_id: Draft([1, 2, 3])}).scheduled
    assert item.draft is None and item.num_new_tokens == 1


def test_finished_aborted_and_failed_requests_are_reported_once():
    s = make_scheduler(budget=16)
    _decoding(s, "done")
    _decoding(s, "aborted")
    _decoding(s, "failed")
    [done] = s.requests["done"]
    out = s.schedule()
    results = {i.seq.seq_id: SeqStepResult([1]) for i in out.scheduled}
    s.update(out, ModelOutput(results))
    s.finish_sequence(done, "stop")
    s.abort_request("aborted")
    s.fail_request(s.requests["failed"][0].request, "boom")
    assert sorted(s.schedule().finished_request_ids) == ["aborted", "done", "failed"]
    assert s.schedule().finished_request_ids == []
