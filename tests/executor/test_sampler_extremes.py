"""The sampler against hostile but representable values that slipped past the front end: the
result is the row's most likely token (or an exact draw where that is meaningful), never a
token picked out of a NaN/inf distribution."""
from __future__ import annotations

import torch

from pagoda.executor.sampler import SampleRow, Sampler, SeedGenerators, apply_penalties, safe_probs
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

VOCAB = 64


def hostile(**values) -> SamplingParams:
    """Valid params, then the hostile values assigned (bypassing validation, as a slip would)."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    for name, value in values.items():
        setattr(params, name, value)
    return params


def row(params: SamplingParams, prompt: list[int] | None = None, generator=None) -> SampleRow:
    return SampleRow(params, generator, prompt or [1, 2], [], ())


def logits_with_argmax(best: int, rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g)
    logits[:, best] = 8.0
    return logits


def test_tiny_top_p_keeps_the_most_likely_token():
    # 1e-300 is 0 in float32: before the fix every token was masked and the draw was garbage.
    sampler = Sampler(0)
    for seed in range(5):
        logits = logits_with_argmax(37, rows=3, seed=seed)
        out = sampler(logits, [row(hostile(top_p=1e-300))] * 3)
        assert out.token_ids == [37, 37, 37]


def test_top_k_past_the_vocabulary_means_no_top_k():
    logits = logits_with_argmax(5, seed=1)
    logits[0, 5] = 1.0  # a spread distribution, so draws differ between seeds
    draws = {}
    for top_k in (-1, VOCAB, 2**63, 9223372036854775808 * 4):
        gen = torch.Generator().manual_seed(7)
        draws[top_k] = [Sampler(0)(logits, [row(hostile(top_k=top_k), generator=gen)]).token_ids[0]
                        for _ in range(20)]
    assert len(set(map(tuple, draws.values()))) == 1
    assert len(set(draws[-1])) > 1


def test_tiny_repetition_penalty_stays_finite_and_ordered():
    # Penalty -> 0 inflates repeated positive logits; 1e-310 used to make them all +inf, and
    # the argmax then fell on the first repeated token (3) rather than the largest (7).
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 3], logits[0, 7], logits[0, 9] = 2.0, 5.0, 4.0
    params = hostile(temperature=0.0, repetition_penalty=1e-310)
    penalised = logits.clone()
    apply_penalties(penalised, [row(params, prompt=[3, 7])])
    assert torch.isfinite(penalised).all()
    assert Sampler(0)(logits, [row(params, prompt=[3, 7])]).token_ids == [7]
    sampled = hostile(repetition_penalty=1e-310)
    assert Sampler(0)(logits, [row(sampled, prompt=[3, 7])]).token_ids == [7]


def test_infinite_or_nan_penalties_do_not_poison_the_row():
    logits = logits_with_argmax(11, seed=2)
    for params in (hostile(frequency_penalty=float("inf")), hostile(presence_penalty=float("-inf")),
                   hostile(repetition_penalty=float("nan")), hostile(repetition_penalty=float("inf"))):
        params.temperature = 0.0
        penalised = logits.clone()
        apply_penalties(penalised, [row(params, prompt=[20])])
        assert not torch.isnan(penalised).any()
        assert Sampler(0)(logits, [row(params, prompt=[20])]).token_ids == [11]


def test_degenerate_distributions_fall_back_to_the_argmax():
    logits = logits_with_argmax(23, seed=3)
    for params in (hostile(temperature=float("nan")), hostile(min_p=5.0), hostile(top_p=float("nan"))):
        assert Sampler(0)(logits, [row(params)]).token_ids == [23]
    nan_row = torch.full((1, VOCAB), float("nan"))
    assert not torch.isnan(safe_probs(nan_row, logits)).any()
    assert safe_probs(nan_row, logits).argmax().item() == 23


def test_well_formed_rows_are_unchanged_by_the_guards():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    assert torch.equal(safe_probs(logits, logits), logits.softmax(-1))


def test_any_int_seed_builds_generators():
    for seed, n in ((1180591620717411303424, 1), (18446744073709551615, 2), (-5, 3)):
        req = Request("r", [1, 2], SamplingParams(n=n, seed=0), (0,))
        req.params.seed = seed
        generators = SeedGenerators()  # the executor's, created on first use
        for i in range(n):
            generators.get(req.request_id, i, req.params.seed)
        assert len(generators) == n
    wrapped = Request("w", [1], SamplingParams(n=2, seed=0), (0,))
    wrapped.params.seed = 2**64 - 1
    generators = SeedGenerators()
    # Sample 1 of seed 2**64 - 1 is seed 0 modulo 2**64.
    assert generators.get(wrapped.request_id, 1, wrapped.params.seed).initial_seed() == 0


def test_sample_from_reads_the_steps_logits_in_place_for_plain_greedy_rows():
    """``sample_from`` gives what ``Sampler.__call__`` gives on the selected rows; plain greedy
    rows take the copy-free path, and the step's logits are never changed."""
    sampler = Sampler(seed=0)
    logits = logits_with_argmax(5, rows=4)
    logits[1, 9] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("nan")
    before = logits.clone()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    cases = [
        [row(greedy) for _ in range(4)],                                          # plain greedy
        [row(SamplingParams(temperature=0, max_tokens=8, logprobs=2)) for _ in range(4)],
        [row(SamplingParams(temperature=0, max_tokens=8, repetition_penalty=10.0), prompt=[5]) for _ in range(4)],
        [SampleRow(SamplingParams(temperature=0, max_tokens=8, min_tokens=2), None, [1], [], (5,))
         for _ in range(4)],                                                      # min_tokens pending
    ]
    order = [3, 0, 2, 1]
    for rows in cases:
        got = sampler.sample_from(logits, order, rows)
        want = sampler(logits[order].clone(), rows)
        assert got.token_ids == want.token_ids
        if want.token_logprobs is None:
            assert got.token_logprobs is None
        else:  # an all-NaN row's logprob is NaN on both paths
            torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs),
                                       equal_nan=True, rtol=0, atol=0)
        assert torch.equal(logits.isnan(), before.isnan())
        assert torch.equal(torch.nan_to_num(logits), torch.nan_to_num(before))
    plain = sampler.sample_from(logits, order, cases[0])
    assert plain.token_ids == [0, 5, 3, 5]  # all-NaN row: 0; +inf: its index; else the argmax
    assert sampler.sample_from(logits, order, cases[2]).token_ids[1] != 5  # the penalty applied
    assert sampler.sample_from(logits, order, cases[3]).token_ids[1] != 5  # stop id 5 suppressed


def test_seeds_that_differ_only_above_32_bits_draw_apart():
    """torch's CPU generator keeps 32 bits of its seed: seeds at or above 2**32 are hashed down
    (``generator_seed``), so 1 and 2**32 + 1 no longer draw alike; seeds below keep their
    stream, and seeds wrap modulo 2**64 (a negative one included)."""
    def draws(seed: int, index: int = 0) -> list[float]:
        return torch.rand(4, generator=SeedGenerators().get("r", index, seed)).tolist()

    assert draws(1) != draws(2**32 + 1) != draws(2**33 + 1)
    assert draws(7) == torch.rand(4, generator=torch.Generator().manual_seed(7)).tolist()
    assert draws(2**64 + 5) == draws(5) and draws(-1) == draws(2**64 - 1)
    assert draws(2**32 - 1, index=1) == draws(2**32)  # sample i draws from seed + i


def test_seed_minus_one_means_no_seed_as_in_vllm():
    from pagoda.sampling_params import SamplingParams

    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_tail_of_output_tokens_reads_only_the_end():
    from pagoda.executor.sampler import OutputTokens, _tail

    tokens = OutputTokens([9, 9, 1, 2, 3, 4, 99], start=2, end=6, extra=[5, 6])  # 1 2 3 4 | 5 6
    assert [_tail(tokens, k) for k in (1, 2, 3, 6)] == [[6], [5, 6], [4, 5, 6], [1, 2, 3, 4, 5, 6]]
    assert _tail(tokens, 9) == [1, 2, 3, 4, 5, 6] and _tail([1, 2, 3], 2) == [2, 3]
