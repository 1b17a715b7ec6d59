"""The plain decode step's fast paths give what the general paths give.

``ModelRunner._sample_plain`` takes a step of plain greedy rows as their argmax without building
sampler rows, and samples other one-token steps from rows in one call; the scheduler's update
has a one-sample branch; ``LogitsPlan.add`` a no-prompt-logprobs branch. Here the same requests
run with the fast path and with it turned off (every step down the general path, row by row),
and beside a request with logprobs (which sends every step it is in down the general path): the
tokens, finish and stop reasons, per-request figures and each step's stats must not change."""
from __future__ import annotations

import msgspec
import pytest

from pagoda import LLM, SamplingParams
from pagoda.executor import model_runner as runner_mod
from pagoda.executor.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Stats that count from the engine's start: compared as what the run added.
RUNNING_TOTALS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions", "num_preemptions",
                  "spec_proposed", "spec_accepted", "num_abandoned_steps")


@pytest.fixture(scope="module")
def llm(llama_dir):
    # One decode step per schedule: rounds of several take the C++ greedy round instead.
    engine = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=256, num_scheduler_steps=1)
    yield engine
    engine.shutdown()


def run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, list]:
    """Each request's samples (tokens, finish and stop reasons, cumulative logprob), its cached
    tokens and preemptions; and each step's stats, running totals as added by this run."""
    engine = llm.engine
    engine.core.kv.reset_prefix_cache()  # every run starts from an empty prefix cache
    before = msgspec.structs.asdict(engine.core.stats())
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    results, stats = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (
                    [(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in out.outputs],
                    out.num_cached_tokens, out.metrics.num_preemptions)
        step = msgspec.structs.asdict(engine.last_stats)
        stats.append({k: v - before[k] if k in RUNNING_TOTALS else v for k, v in step.items()})
    return results, stats


def mixed_batch(llm: LLM) -> dict[str, tuple[list[int], SamplingParams]]:
    """Plain greedy rows, and rows that are not plain for part of their life: a pending
    min_tokens, a stop token met on the way, a seeded sampled row, n = 2 (a fork)."""
    first = run(llm, {"probe": ([11, 12, 13, 14], GREEDY)})[0]["probe"][0][0][0]
    stop_id = first[4]  # met by a request with the same prompt, at the 5th token or before
    return {
        "plain": ([11, 12, 13, 14], GREEDY),
        "stop_token": ([11, 12, 13, 14], GREEDY.clone(stop_token_ids=[stop_id], ignore_eos=False)),
        "min_tokens": (list(range(100, 130)), GREEDY.clone(min_tokens=6, ignore_eos=False, max_tokens=12)),
        "seeded": ([400, 3, 99], SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)),
        "forked": (list(range(200, 221)), GREEDY.clone(n=2, max_tokens=6)),
        "long": (list(range(30, 60)), GREEDY.clone(max_tokens=16)),
    }


def test_fast_path_matches_the_general_path(llm, monkeypatch) -> None:
    batch = mixed_batch(llm)
    served: list[bool] = []  # per fast-path step: whether it built sampler rows
    real_plain, real_row = ModelRunner._sample_plain, runner_mod.sample_row
    built = [0]

    def spy_plain(self, plan, logits, produced):
        built[0] = 0
        out = real_plain(self, plan, logits, produced)
        if out is not None:
            served.append(built[0] > 0)
        return out

    def spy_row(*args, **kwargs):
        built[0] += 1
        return real_row(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_sample_plain", spy_plain)
        m.setattr(runner_mod, "sample_row", spy_row)
        fast = run(llm, batch)
    # Both shortcuts served steps: plain greedy ones without rows, and ones from rows (min_tokens pending).
    assert False in served and True in served
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_sample_plain", lambda self, plan, logits, produced: None)
        general = run(llm, batch)
    assert fast[0] == general[0]
    assert fast[1] == general[1]
    assert fast[0]["stop_token"][0][0][1] == "stop" and fast[0]["plain"][0][0][1] == "length"


def test_greedy_outputs_unchanged_by_a_logprobs_request_in_the_batch(llm) -> None:
    greedy = {k: v for k, v in mixed_batch(llm).items() if v[1].greedy}
    alone = run(llm, greedy)[0]
    with_logprobs = run(llm, {**greedy, "logprobs": (list(range(300, 320)),
                                                     GREEDY.clone(logprobs=2, prompt_logprobs=1, max_tokens=20))})[0]
    assert with_logprobs.pop("logprobs")[0][0][3] is not None  # it did report logprobs
    assert with_logprobs == alone
