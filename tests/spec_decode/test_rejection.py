"""The rejection sampler on synthetic target and draft distributions: what it emits must be
distributed exactly as the target's own samples, whatever the draft."""
from __future__ import annotations

import pytest
import torch
from spec_stats import fits

from pagoda.executor.sampler import SampleRow
from pagoda.sampling_params import SamplingParams
from pagoda.executor import rejection
from pagoda.executor.rejection import DraftRow, verify

N = 20000
# Target distributions at positions 0, 1, 2 and draft distributions at positions 0, 1.
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                  [0.05, 0.10, 0.50, 0.20, 0.10, 0.05],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])


def _row(params: SamplingParams, generator: torch.Generator | None = None,
         output: list[int] | None = None) -> SampleRow:
    return SampleRow(params, generator, [0], output or [], (5,))


def _run(params: SamplingParams, dense: bool, seed: int = 0) -> list[list[int]]:
    """Verify N independent two-token drafts against logits ``log P``; drafts come from ``Q``
    (dense) or are the fixed tokens [0, 2] (point mass, as n-gram proposals are)."""
    gen = torch.Generator().manual_seed(seed)
    if dense:
        drafts = torch.stack([torch.multinomial(Q[j], N, replacement=True, generator=gen) for j in range(2)], 1)
    else:
        drafts = torch.tensor([[0, 2]]).expand(N, 2)
    rows = [DraftRow(_row(params), d, Q if dense else None) for d in drafts.tolist()]
    logits = P.log().repeat(N, 1)
    return [v.token_ids for v in verify(logits, rows, gen)]


def _first(tokens: list[list[int]]) -> list[int]:
    return [t[0] for t in tokens]


def _second(tokens: list[list[int]]) -> list[int]:
    """The second emitted token, where the first draft was accepted (it is then distributed as
    the target's position-1 distribution)."""
    return [t[1] for t in tokens if len(t) > 1]


def _as_dict(p: torch.Tensor) -> dict[int, float]:
    return {i: float(x) for i, x in enumerate(p) if x > 0}


@pytest.mark.parametrize("dense", [True, False], ids=["draft-model", "point-mass"])
def test_emitted_tokens_follow_the_target_at_temperature_1(dense: bool) -> None:
    tokens = _run(SamplingParams(temperature=1.0), dense)
    assert fits(_first(tokens), _as_dict(P[0]))
    assert fits(_second(tokens), _as_dict(P[1]))
    assert 0 < sum(len(t) - 1 for t in tokens) < 2 * N  # some drafts accepted, some rejected


def test_emitted_tokens_follow_the_top_p_target() -> None:
    # top_p 0.68 keeps tokens 0..2 at position 0 (0.40 + 0.25 = 0.65 < 0.68) and 2, 3 at position 1.
    tokens = _run(SamplingParams(temperature=1.0, top_p=0.68), dense=True)
    p0 = torch.tensor([0.40, 0.25, 0.15, 0, 0, 0])
    p1 = torch.tensor([0, 0, 0.50, 0.20, 0, 0])
    assert fits(_first(tokens), _as_dict(p0 / p0.sum()))
    assert fits(_second(tokens), _as_dict(p1 / p1.sum()))


@pytest.mark.parametrize("dense", [True, False], ids=["draft-model", "point-mass"])
def test_a_broken_acceptance_rule_fails_the_same_check(monkeypatch: pytest.MonkeyPatch, dense: bool) -> None:
    monkeypatch.setattr(rejection, "accept_rule", lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    tokens = _run(SamplingParams(temperature=1.0), dense)
    assert not fits(_first(tokens), _as_dict(P[0]))


def test_greedy_accepts_while_drafts_equal_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    [v] = verify(logits, [DraftRow(_row(greedy), [1, 2, 1], None)], None)
    assert (v.token_ids, v.num_accepted) == ([1, 2, 0], 2)
    [v] = verify(logits, [DraftRow(_row(greedy), [1, 2, 0], None)], None)
    assert (v.token_ids, v.num_accepted) == ([1, 2, 0, 1], 3)  # all accepted: the bonus token too
    [v] = verify(logits, [DraftRow(_row(greedy), [2, 2, 0], None)], None)
    assert (v.token_ids, v.num_accepted) == ([1], 0)


def test_penalties_count_the_drafts_before_each_position() -> None:
    # Token 1 leads everywhere, but a presence penalty applies once it has been produced: after
    # an accepted draft 1, the target's choice at the next position is token 2.
    logits = torch.tensor([[0.0, 3.0, 2.0]] * 3)
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    [v] = verify(logits, [DraftRow(_row(params), [1, 1], None)], None)
    assert (v.token_ids, v.num_accepted) == ([1, 2], 1)
    params = SamplingParams(temperature=0, min_tokens=2)  # stop token 5 is banned for 2 outputs
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]] * 3)
    [v] = verify(logits, [DraftRow(_row(params, output=[4]), [0, 5], None)], None)
    assert v.token_ids == [0, 5, 5]  # position 1 may stop: two outputs exist by then


def test_seeded_rows_reproduce_and_ignore_the_default_generator() -> None:
    params = SamplingParams(temperature=1.0, seed=7)

    def once(default_seed: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(100 + i) for i in range(50)]
        rows = [DraftRow(_row(params, g), [3, 4], Q) for g in gens]
        return [v.token_ids for v in verify(P.log().repeat(50, 1), rows, torch.Generator().manual_seed(default_seed))]

    assert once(0) == once(1)
