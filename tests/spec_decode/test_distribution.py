"""End to end: with speculation on, sampled outputs are distributed as the target model's own,
and seeded requests reproduce."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from spec_helpers import generate, random_prompts
from spec_stats import fits

from pagoda import LLM, SamplingParams
from pagoda.executor import rejection

TOP_K = 4
SAMPLED = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)
N = 3000


def _next_token_probs(llm: LLM, contexts: list[list[int]]) -> list[dict[int, float]]:
    """The target's top-k distribution after each context, from its raw top-k logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
    dists = []
    for out in outs:
        top = out.outputs[0].logprobs[0]
        total = sum(math.exp(lp) for lp in top.values())
        dists.append({t: math.exp(lp) / total for t, lp in top.items()})
    return dists


def _exact_joint(llm: LLM, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of the target sampling three tokens with top-k and temperature 1."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        prefixes = list(joint)
        dists = _next_token_probs(llm, [prompt + list(p) for p in prefixes])
        joint = {p + (t,): joint[p] * q for p, d in zip(prefixes, dists) for t, q in d.items()}
    return joint


@pytest.fixture(scope="module")
def setup(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[list[int], dict[tuple[int, ...], float], LLM]:
    from pagoda.bench.spec import truncate_layers

    prompt = random_prompts(1, seed=20, lo=12, hi=12)[0]["prompt_token_ids"]
    exact = _exact_joint(LLM(str(llama_dir), kv_cache_memory=8 << 20), prompt)
    # A draft that shares the target's first layer and head: it agrees sometimes, so both the
    # acceptance and the residual paths run.
    draft = truncate_layers(llama_dir, tmp_path_factory.mktemp("draft"), 1)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    spec = LLM(str(llama_dir), kv_cache_memory=64 << 20, speculative_config=config)
    return prompt, exact, spec


def _samples(spec: LLM, prompt: list[int]) -> list[tuple[int, ...]]:
    return [tuple(t) for t in generate(spec, [{"prompt_token_ids": prompt}] * N, SAMPLED)]


def test_sampled_tokens_follow_the_target_distribution(setup) -> None:
    prompt, exact, spec = setup
    proposer = spec.engine.core.proposer
    before = (proposer.num_proposed, proposer.num_accepted)
    assert fits(_samples(spec, prompt), exact)
    proposed, accepted = proposer.num_proposed - before[0], proposer.num_accepted - before[1]
    assert proposed >= N and 0.05 < accepted / proposed < 0.95


def test_always_accepting_fails_the_same_check(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, exact, spec = setup
    monkeypatch.setattr(rejection, "accept_rule", lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    assert not fits(_samples(spec, prompt), exact)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_requests_reproduce_alone_or_in_a_batch(llama_dir, model_factory, method: str) -> None:
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = str(model_factory("llama", seed=99))
    llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, speculative_config=config)
    # A prompt that repeats itself, so n-gram proposals exist.
    p = {"prompt_token_ids": list(itertools.islice(itertools.cycle([40, 41, 42, 43, 44]), 30))}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=25, ignore_eos=True)
    alone = generate(llm, [p], seeded)[0]
    others = random_prompts(5, seed=21)
    batch = generate(llm, others + [p], [SamplingParams(temperature=1.0, max_tokens=25)] * 5 + [seeded])
    assert batch[-1] == alone
    assert llm.engine.core.proposer.num_proposed > 0
    assert generate(llm, [p], seeded.clone(seed=6))[0] != alone
