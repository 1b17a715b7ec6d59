"""Stop strings wait for min_tokens, like stop tokens do, and end an output of several tokens at
the token that completed the match; a failed request ends with "error"."""
from __future__ import annotations

from pagoda.engine.messages import EngineCoreOutput
from pagoda.engine.output_processor import OutputProcessor
from pagoda.sampling_params import SamplingParams


class LetterTokenizer:
    """Token i is the letter chr(97 + i); no fast backend, so the slow decode path is used."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


def feed(params: SamplingParams, tokens: list[int], per_step: int = 1):
    proc = OutputProcessor(LetterTokenizer())
    proc.add_request("r", None, [0], params, 0.0)
    state, aborts = proc.requests["r"], []
    for i in range(0, len(tokens), per_step):
        _, new = proc.process([EngineCoreOutput("r", 0, tokens[i:i + per_step])])
        aborts.extend(new)
        if state.samples[0].finish_reason is not None:
            break
    return state.samples[0], aborts


def test_stop_string_before_min_tokens_is_ignored():
    # "b" appears at tokens 2 and 6; with min_tokens 4 only the second one stops.
    tokens = [0, 1, 2, 3, 4, 5, 1, 7, 8]
    sample, aborts = feed(SamplingParams(stop=["b"], min_tokens=4, max_tokens=20), tokens)
    assert sample.finish_reason == "stop" and sample.text == "abcdef"
    assert len(sample.token_ids) == 7 and [a.stop_reason for a in aborts] == ["b"]


def test_without_min_tokens_the_first_occurrence_stops():
    sample, _ = feed(SamplingParams(stop=["b"], max_tokens=20), [0, 1, 2, 3])
    assert sample.text == "a" and len(sample.token_ids) == 2


def test_min_tokens_reached_within_a_multi_token_step():
    # Tokens arrive 3 at a time (speculation): the step that reaches min_tokens is checked.
    sample, _ = feed(SamplingParams(stop=["c"], min_tokens=3, max_tokens=20), [0, 1, 2, 3, 4, 5], per_step=3)
    assert sample.finish_reason == "stop" and sample.text == "ab"


def test_an_output_of_several_tokens_ends_at_the_token_that_completed_the_stop_string():
    # Four tokens in one output (a multi-step round): "bc" is complete at the third, the fourth
    # was generated past it and is dropped with its logprob; usage then counts three tokens.
    proc = OutputProcessor(LetterTokenizer())
    state = proc.add_request("r", None, [0], SamplingParams(stop=["bc"], logprobs=0, max_tokens=20), 0.0)
    logprobs = [{t: -0.5 * (t + 1)} for t in (0, 1, 2, 3)]
    _, aborts = proc.process([EngineCoreOutput("r", 0, [0, 1, 2, 3], new_logprobs=logprobs,
                                               cumulative_logprob=-5.0)])
    sample = state.samples[0]
    assert sample.finish_reason == "stop" and sample.text == "a" and [a.stop_reason for a in aborts] == ["bc"]
    assert sample.token_ids == [0, 1, 2] and sample.logprobs == logprobs[:3]
    assert sample.cumulative_logprob == -3.0  # -0.5 - 1.0 - 1.5: the dropped token's -2.0 taken off


def test_the_same_tokens_one_at_a_time_or_all_at_once():
    params = SamplingParams(stop=["cd"], include_stop_str_in_output=True, max_tokens=20)
    one, _ = feed(params, [0, 1, 2, 3, 4, 5, 6])
    many, _ = feed(params, [0, 1, 2, 3, 4, 5, 6], per_step=7)
    assert one.token_ids == many.token_ids == [0, 1, 2, 3] and one.text == many.text == "abcd"


def test_fail_marks_unfinished_samples_error():
    proc = OutputProcessor(LetterTokenizer())
    proc.add_request("r", None, [0], SamplingParams(n=2, max_tokens=5), 0.0)
    proc.process([EngineCoreOutput("r", 0, [1], finish_reason="length")])
    state = proc.fail("r")
    assert [s.finish_reason for s in state.samples] == ["length", "error"]
    assert state.finished and "r" not in proc.requests and proc.fail("r") is None
