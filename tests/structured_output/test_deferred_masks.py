"""Deferred grammar masks at the sampler and matcher level (executor.sampler.resample_refused): the
sample-first path draws exactly the masked distribution, and a matcher's ``allows`` is its mask."""
from __future__ import annotations

import random

import pytest
import torch

from pagoda.executor.sampler import SampleRow, Sampler, SeedGenerators
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.bitmask import apply_bitmask_, unpack_bitmask

VOCAB = 40


def _bitmask(allowed: set[int], vocab: int = VOCAB) -> torch.Tensor:
    bits = torch.zeros(vocab + (-vocab) % 32, dtype=torch.int64)
    bits[list(allowed)] = 1
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[None, :]


class FixedGrammar:
    """A deferred grammar with a fixed allowed set (the manager's DeferredMask interface)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.mask, self.refused = allowed, _bitmask(allowed), 0

    def allows(self, token: int) -> bool:
        self.refused += token not in self.allowed
        return token in self.allowed

    def rows(self) -> torch.Tensor:
        return self.mask

    @staticmethod
    def fill_many(items) -> None:
        pass


def _rows(params: SamplingParams, count: int, gens: SeedGenerators, allowed: set[int], deferred: bool):
    rows = []
    for i in range(count):
        row = SampleRow(params, gens.get(f"r{i}", 0, params.seed), [1], [], ())
        if deferred:
            row.grammar = FixedGrammar(allowed)
        else:
            row.bitmask = _bitmask(allowed)[0]
        rows.append(row)
    return rows


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_deferred_sampling_is_the_masked_path_draw_for_draw(temperature):
    """Same seeds, same logits: the sample-first path and the mask-first path pick the same
    token on every draw (the refused rows re-race with the same exponential draw)."""
    torch.manual_seed(0)
    allowed = {1, 3, 4, 17, 33, 39}
    rows_n, steps = 16, 30
    gens = {d: SeedGenerators() for d in (True, False)}
    params = SamplingParams(temperature=temperature, seed=11, presence_penalty=0.5)
    refused = 0
    for _ in range(steps):
        logits = torch.randn(rows_n, VOCAB) * 3
        out = {}
        for deferred in (True, False):
            rows = _rows(params, rows_n, gens[deferred], allowed, deferred)
            out[deferred] = Sampler(5)(logits.clone(), rows).token_ids
            if deferred:
                refused += sum(r.grammar.refused for r in rows)
        assert out[True] == out[False]
        assert all(t in allowed for t in out[True])
    assert 0 < refused < rows_n * steps  # both branches taken


def test_deferred_sampling_distribution_is_p_restricted_and_renormalised():
    """With a fixed seed, 6000 draws (30 batches of 200 rows) from one distribution under a grammar: the frequencies
    match p restricted to the allowed tokens and renormalised (and a token with most of the mass
    outside it is refused often)."""
    vocab, allowed = 8, {1, 3, 4}
    logits = torch.tensor([[2.0, 0.5, 1.5, -0.5, 0.0, 1.0, 0.3, -1.0]])
    p = logits.softmax(-1)[0]
    expected = torch.zeros(vocab)
    expected[list(allowed)] = p[list(allowed)] / p[list(allowed)].sum()
    params = SamplingParams(temperature=1.0)  # unseeded: the sampler's own (seeded) generator
    sampler, counts, grammar = Sampler(3), torch.zeros(vocab), FixedGrammar(allowed)
    grammar.mask = _bitmask(allowed, vocab)
    draws, batch = 6000, 200
    for _ in range(draws // batch):
        rows = [SampleRow(params, None, [1], [], (), grammar=grammar) for _ in range(batch)]
        for t in sampler(logits.expand(batch, vocab).clone(), rows).token_ids:
            counts[t] += 1
    freq = counts / draws
    assert freq[[0, 2, 5, 6, 7]].sum() == 0
    # 4 standard errors of a binomial proportion at 6000 draws is at most 0.026.
    assert torch.allclose(freq, expected, atol=0.026), (freq, expected)
    assert grammar.refused > draws * (1 - p[list(allowed)].sum()) * 0.8


@pytest.mark.parametrize("name", ["guidance", "xgrammar"])
def test_matcher_allows_is_its_mask(name):
    """``Matcher.allows(t)`` (the deferred path's check) agrees with the matcher's own mask on
    every token of the vocabulary, along a seeded random walk through a JSON schema."""
    from pagoda.structured_output import StructuredOutputsParams
    from pagoda.structured_output.backend import make_backend
    from pagoda.tools.make_model import build_tokenizer

    tok = build_tokenizer(512)
    vocab = len(tok)
    backend = make_backend(name, tok, vocab, [tok.eos_token_id])
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                               "b": {"enum": ["x", "yz"]}, "c": {"type": "integer"}},
              "required": ["a", "b", "c"], "additionalProperties": False}
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=schema)))
    rng = random.Random(0)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    for _ in range(25):
        backend.fill_bitmask(bitmask, [(matcher, 0, [])])
        mask = unpack_bitmask(bitmask, vocab)[0].tolist()
        assert [matcher.allows(t) for t in range(vocab)] == mask
        token = rng.choice([t for t in range(vocab) if mask[t]])
        assert matcher.accept(token)
        if matcher.is_terminated():
            break


def test_bitmask_kernel_matches_torch_on_strided_rows():
    """The C kernel and the torch path give the same logits, also on rows taken out of a wider
    tensor, and with a vocabulary that is not a multiple of 32."""
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    masks = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    masks[1] = 0
    masks[2] = -1
    wide = torch.randn(4, vocab + 24, generator=g)
    a, b = wide[:, :vocab].clone(), wide.clone()[:, :vocab]
    apply_bitmask_(a, masks, use_kernel=False)
    apply_bitmask_(b, masks)  # strided rows: the kernel reads the row stride
    assert torch.equal(a, b)
    assert torch.isinf(a[1]).all() and torch.equal(a[2], wide[2, :vocab])


@pytest.mark.parametrize("name", ["guidance", "xgrammar"])
def test_batched_fill_equals_row_by_row(name):
    """The backends' one-call batch fill (parallel, GIL released) writes the same rows as one
    call per matcher, into the rows the jobs name."""
    from pagoda.structured_output import StructuredOutputsParams
    from pagoda.structured_output.backend import make_backend
    from pagoda.tools.make_model import build_tokenizer

    tok = build_tokenizer(512)
    vocab = len(tok)
    backend = make_backend(name, tok, vocab, [tok.eos_token_id])
    compiled = backend.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "minItems": 50}))
    matchers = [backend.matcher(compiled) for _ in range(3)]
    rng = random.Random(1)
    for _ in range(6):
        together = torch.full((5, (vocab + 31) // 32), -1, dtype=torch.int32)
        alone = together.clone()
        backend.fill_bitmask(together, [(m, 1 + i, []) for i, m in enumerate(matchers)])
        for i, m in enumerate(matchers):
            backend.fill_bitmask(alone, [(m, 1 + i, [])])
        assert torch.equal(together, alone) and (together[0] == -1).all() and (together[4] == -1).all()
        for i, m in enumerate(matchers):
            mask = unpack_bitmask(together[1 + i:2 + i], vocab)[0]
            mask[tok.eos_token_id] = False  # keep walking: the array stays open
            assert m.accept(rng.choice(mask.nonzero().flatten().tolist()))
