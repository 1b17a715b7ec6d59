"""A sampler row sees its sequence's output tokens without copying them (``OutputTokens``): the
step's host work must not grow with the output's length (a copy a step made a generation's host
work grow with the square of its length)."""
from __future__ import annotations

from pagoda.executor.sampler import OutputTokens, SeedGenerators, _token_counts, sample_row
from pagoda.request import Request, Sequence
from pagoda.sampling_params import SamplingParams


def test_the_view_is_the_output_then_the_drafts_as_they_were():
    ids = [1, 2, 3, 10, 11]
    view = OutputTokens(ids, 3, extra=(20, 21))
    assert len(view) == 4 and list(view) == [10, 11, 20, 21] and view == [10, 11, 20, 21]
    assert view[1] == 11 and view[-1] == 21 and view[1:3] == [11, 20] and view + [5] == [10, 11, 20, 21, 5]
    ids.append(12)  # appended after the row was made: not part of it
    assert len(view) == 4 and view.tolist() == [10, 11, 20, 21] and 12 not in view
    assert len(OutputTokens(ids, 6)) == 0 and list(OutputTokens(ids, 6)) == []


def test_sample_rows_share_the_sequences_tokens():
    params = SamplingParams(max_tokens=8, repetition_penalty=1.2)
    request = Request("r", [5, 6, 7], params, eos_token_ids=(0,))
    seq = Sequence("r", request, [5, 6, 7])
    seq.token_ids.extend([9, 9, 4])
    row = sample_row(seq, SeedGenerators(), drafts=[8])
    assert isinstance(row.output_token_ids, OutputTokens) and row.output_token_ids.ids is seq.token_ids
    assert row.output_token_ids == [9, 9, 4, 8] and len(row.output_token_ids) == 4
    counts = _token_counts([row.output_token_ids, [], [3]], 12, "cpu")  # the penalties' counts
    assert counts[0, 9] == 2 and counts[0, 4] == 1 and counts[0, 8] == 1 and counts[1].sum() == 0 and counts[2, 3] == 1
