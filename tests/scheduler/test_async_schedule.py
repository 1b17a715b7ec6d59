"""Async scheduling in the scheduler alone (fake model: next token = last + 1): scheduling step
N + 1 after ``advance(N)`` and before N's ``update`` gives every sequence the very tokens, finish
reasons and block accounting of the synchronous order, through chunked prefill, eos and
max_tokens stops at different steps, aborts, preemption under a tiny pool and n > 1 forks."""
from __future__ import annotations

from pagoda.engine.async_scheduling import runs_ahead
from pagoda.request import Request, Sequence
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import PLACEHOLDER_TOKEN, Scheduler
from pagoda.step import ModelOutput, SchedulerOutput, SeqStepResult
from tests.scheduler.test_scheduler import make_scheduler

EOS = 77


def _results(sched: SchedulerOutput, before: ModelOutput | None) -> ModelOutput:
    """The fake model's step: each sampling sequence's next token is its last plus one (plus the
    sample index at a fork); a placeholder reads the token the step before sampled, as the
    runner's ``fill_placeholders`` does."""
    out = ModelOutput()
    for item in sched.scheduled:
        if not item.samples:
            continue
        seq = item.seq
        last = seq.token_ids[item.end - 1]
        if last == PLACEHOLDER_TOKEN:
            assert before is not None and seq.seq_id in before.results, "a placeholder nobody fills"
            last = before.results[seq.seq_id].token_ids[0]
        out.results[seq.seq_id] = SeqStepResult([last + 1 + i for i in range(seq.num_samples)])
    return out


def _add_requests(s: Scheduler) -> None:
    specs = [  # (prompt length, first token, max_tokens, n, ignore_eos)
        (5, 60, 30, 1, False),   # reaches EOS (77) after 12 tokens
        (23, 100, 9, 1, True),   # a chunked prompt, stops by max_tokens
        (3, 200, 17, 2, True),   # forks into two samples
        (41, 300, 6, 1, True),   # a long chunked prompt
        (7, 400, 25, 1, True),
        (2, 70, 40, 1, False),   # EOS after 6 tokens
    ]
    for i, (length, first, max_tokens, n, ignore_eos) in enumerate(specs):
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
        s.add_request(Request(f"r{i}", list(range(first, first + length)), params, (EOS,)))


def _run(s: Scheduler, ahead: bool, abort_at: int | None = None) -> dict[str, tuple]:
    """Step ``s`` until it is done, scheduling ahead where allowed when ``ahead``; after
    ``abort_at`` steps the newest running request is aborted. Returns each sequence's tokens
    and finish reason."""
    seen: dict[str, Sequence] = {}
    flight, result = s.schedule(), None
    result = _results(flight, None)
    steps = ran_ahead = 0
    while True:
        following = following_result = None
        if ahead and runs_ahead(flight):
            s.advance(flight)
            following = s.schedule()
            following_result = _results(following, result)
            ran_ahead += 1
        s.update(flight, result)
        seen.update({item.seq.seq_id: item.seq for item in flight.scheduled})
        steps += 1
        if steps == abort_at:
            s.abort_request(s.running[-1].request_id)
        if following is None:
            if not s.has_unfinished():
                break
            following = s.schedule()
            following_result = _results(following, None)
        flight, result = following, following_result
        assert steps < 2000
    assert not ahead or ran_ahead > steps // 2
    assert not s.running and not s.waiting
    s.kv.check_invariants([])
    for seq in seen.values():
        assert PLACEHOLDER_TOKEN not in seq.token_ids
    return {sid: (seq.token_ids, seq.finish_reason, seq.stop_reason) for sid, seq in sorted(seen.items())}


def test_ahead_matches_synchronous_order_with_chunks_and_stops():
    outs = {}
    for ahead in (False, True):
        s = make_scheduler(num_blocks=64, budget=16)
        _add_requests(s)
        outs[ahead] = _run(s, ahead)
    assert outs[True] == outs[False]
    reasons = {sid: r for sid, (_, r, _) in outs[False].items()}
    assert reasons["r0#0"] == "stop" and reasons["r5#0"] == "stop" and reasons["r1#0"] == "length"
    assert "r2#1" in reasons  # the fork happened


def test_ahead_matches_synchronous_order_under_preemption_and_abort():
    outs, preemptions = {}, {}
    for ahead in (False, True):
        s = make_scheduler(num_blocks=14, budget=16)
        _add_requests(s)
        outs[ahead] = _run(s, ahead, abort_at=6)
        preemptions[ahead] = s.num_preemptions
    assert preemptions[True] > 0 and preemptions[False] > 0
    assert outs[True] == outs[False]
    assert "abort" in [r for _, r, _ in outs[True].values()]


def test_a_sequence_preempted_after_its_step_was_scheduled_gets_its_token():
    """The step scheduled ahead preempts a sequence whose token is still being sampled: its
    update writes the token over the placeholder and the recomputation continues from it."""
    s = make_scheduler(num_blocks=64, budget=16)
    _add_requests(s)
    flight = s.schedule()
    s.update(flight, _results(flight, None))
    flight = s.schedule()
    result = _results(flight, None)
    s.advance(flight)
    victim = s.running[-1]
    s._preempt(victim)
    assert victim.token_ids[-1] == PLACEHOLDER_TOKEN
    s.update(flight, result)
    assert victim.token_ids[-1] == result.results[victim.seq_id].token_ids[0]
    assert victim.num_computed_tokens == 0 and victim in s.waiting


def test_a_sequence_whose_step_ends_it_by_length_is_not_scheduled_again():
    """Its token is its last (max_tokens): the step scheduled ahead leaves it out, no decode of
    a sequence known to end, and its update ends it as usual."""
    s = make_scheduler()
    s.add_request(Request("x", list(range(5)), SamplingParams(max_tokens=2, ignore_eos=True), (EOS,)))
    first = s.schedule()
    s.update(first, _results(first, None))
    step = s.schedule()
    seq = step.scheduled[0].seq
    result = _results(step, None)
    s.advance(step)
    assert PLACEHOLDER_TOKEN not in seq.token_ids and s.schedule().is_empty
    s.update(step, result)
    assert seq.finish_reason == "length" and seq.output_token_ids == [5, 6] and not s.running
    s.kv.check_invariants([])
