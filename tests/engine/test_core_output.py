"""``EngineCore._output`` sets only the fields of an ``EngineCoreOutput`` that differ from their
defaults; the message must be the one the all-fields form builds, field for field and byte for
byte on the wire, whatever the sequence's state."""
from __future__ import annotations

import msgspec
import pytest

from pagoda import SamplingParams
from pagoda.engine.core import EngineCore
from pagoda.engine.messages import EngineCoreOutput
from pagoda.request import Request, SeqStatus, Sequence
from pagoda.scheduler.scheduler import SeqUpdate


def all_fields(u: SeqUpdate) -> EngineCoreOutput:
    """The message as ``_output`` built it before it named only non-default fields."""
    seq, m = u.seq, u.seq.request.metrics
    finished = seq.finished
    events = seq.request.trace_events
    if events:
        seq.request.trace_events = []
    return EngineCoreOutput(
        request_id=seq.request_id, index=seq.sample_index, new_token_ids=u.new_token_ids,
        new_logprobs=u.new_logprobs, finish_reason=seq.finish_reason if finished else None,
        stop_reason=seq.stop_reason if finished else None, num_cached_tokens=seq.request.num_cached_tokens,
        cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
        prompt_logprobs=u.prompt_logprobs, prompt_ranks=u.prompt_ranks, arrival_time=m.arrival_time,
        first_scheduled_time=m.first_scheduled_time, first_token_time=m.first_token_time,
        finished_time=m.finished_time if finished else None, num_preemptions=m.num_preemptions,
        spec_proposed=m.spec_proposed_tokens, spec_accepted=m.spec_accepted_tokens, embedding=u.embedding,
        trace_events=events or None)


def _update(params: SamplingParams | None = None, **state) -> SeqUpdate:
    request = Request("req-1", [5, 6, 7], params or SamplingParams(max_tokens=8), (2,), arrival_time=100.0)
    seq = Sequence("req-1", request, [5, 6, 7, 9], sample_index=state.pop("index", 0))
    seq.status = SeqStatus.RUNNING
    request.metrics.first_scheduled_time, request.metrics.first_token_time = 100.5, 101.0
    for key, value in state.pop("seq", {}).items():
        setattr(seq, key, value)
    for key, value in state.pop("request", {}).items():
        setattr(request, key, value)
    for key, value in state.pop("metrics", {}).items():
        setattr(request.metrics, key, value)
    return SeqUpdate(seq, state.pop("new_token_ids", [9]), **state)


FINISHED = {"status": SeqStatus.FINISHED, "finish_reason": "stop", "stop_reason": 7}
CASES = {
    "decode": _update(),
    "first_token_pending": _update(metrics={"first_token_time": None}),
    "second_sample": _update(index=1),
    "finished_stop_token": _update(seq=FINISHED, metrics={"finished_time": 102.0}),
    "finished_length": _update(seq={"status": SeqStatus.FINISHED, "finish_reason": "length"},
                               metrics={"finished_time": 102.0}),
    # A finish reason on a sequence that is not finished (yet) is not sent.
    "reason_but_running": _update(seq={"finish_reason": "stop", "stop_reason": "x"}, metrics={"finished_time": 3.0}),
    "logprobs": _update(SamplingParams(logprobs=2), seq={"cumulative_logprob": -1.5},
                        new_logprobs=[{9: -0.25, 4: -2.0}]),
    "logprobs_zero_cumulative": _update(SamplingParams(logprobs=0)),
    "prompt_logprobs": _update(prompt_logprobs=[None, {6: -1.0}], prompt_ranks=[None, 3]),
    "cached_preempted_spec": _update(request={"num_cached_tokens": 16},
                                     metrics={"num_preemptions": 1, "spec_proposed_tokens": 5,
                                              "spec_accepted_tokens": 3}),
    "spec_accepted_only": _update(metrics={"spec_accepted_tokens": 1}),
    "embedding": _update(new_token_ids=[], embedding=[0.5, -0.25], seq=FINISHED),
    "no_tokens": _update(new_token_ids=[]),
    "traced": _update(request={"trace_events": [("prefill_chunk", 100.6, 0, 3)]}),
    "traced_nothing_new": _update(request={"trace_events": []}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_is_the_all_fields_message(name: str) -> None:
    u = CASES[name]
    events = u.seq.request.trace_events
    expected = all_fields(u)
    u.seq.request.trace_events = list(events) if events is not None else None
    got = EngineCore._output(None, u)  # (it reads nothing of the core)
    assert got == expected
    assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(expected)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(got), type=EngineCoreOutput) == expected
    assert u.seq.request.trace_events == ([] if events else events)  # the events went out once
