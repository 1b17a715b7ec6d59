"""Async scheduling (``async_scheduling``): the engine schedules and builds step N + 1 while step
N runs, and its outputs are exactly the synchronous engine's: greedy and seeded sampling, mixed
prefill / decode batches with chunked prefill, stops by eos, stop ids, max_tokens and stop
strings at different steps, n > 1, aborts mid-run and preemption under a tiny KV pool."""
from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine import async_scheduling
from pagoda.scheduler.scheduler import PLACEHOLDER_TOKEN


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(rng.randint(3, 60))]} for _ in range(n)]


def _params(stop: int) -> list[SamplingParams]:
    """Greedy and seeded requests ending at different steps, plus some that run synchronously
    (penalties, min_tokens, prompt logprobs; a prompt forking into n samples)."""
    return [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=29),
        SamplingParams(temperature=0, max_tokens=41, stop_token_ids=[stop]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=33, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=19),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, min_tokens=9),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1),
    ]


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[list[tuple]]:
    """Per request, per sample: tokens, finish and stop reasons, text, and the cumulative logprob
    to 5 significant digits (a batch of other rows may change float32 logits in the last bits)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text,
              None if c.cumulative_logprob is None else float(f"{c.cumulative_logprob:.5g}")) for c in o.outputs]
            for o in outs]


def _engine(llama_dir, **kw) -> LLM:
    return LLM(str(llama_dir), max_model_len=256, num_scheduler_steps=1, max_num_batched_tokens=48, **kw)


@pytest.fixture(scope="module")
def engines(llama_dir):
    made = {ahead: _engine(llama_dir, kv_cache_memory=32 << 20, async_scheduling=ahead) for ahead in (False, True)}
    yield made
    for llm in made.values():
        llm.shutdown()


def _count_ahead(llm: LLM) -> list[int]:
    """Counts the steps the engine scheduled ahead of (a spy on ``Scheduler.advance``)."""
    calls = [0]
    scheduler = llm.engine.core.scheduler
    real = scheduler.advance

    def spy(sched):
        calls[0] += 1
        real(sched)

    scheduler.advance = spy
    return calls


def _check_clean(llm: LLM) -> None:
    core = llm.engine.core
    core._drain()
    assert not core.scheduler.running and not core.scheduler.waiting
    core.kv.check_invariants([])


def test_outputs_equal_the_synchronous_engine(engines):
    sync, ahead = engines[False], engines[True]
    prompts = _prompts(len(_params(0)), seed=4)
    stop = sync.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids[6]
    params = _params(stop)
    expected = _run(sync, prompts, params)
    calls = _count_ahead(ahead)
    assert _run(ahead, prompts, params) == expected
    assert calls[0] > 20  # it really ran ahead, for most steps
    assert expected[2][0][1] == "stop" and expected[2][0][2] == stop  # a stop id ended one early
    # A stop string found by the front end (an abort of the sample) after some step.
    text = expected[0][0][3]
    cut = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, stop=[text[len(text) // 2:][:3]])
    mixed = [cut, *params[1:5]]
    assert _run(ahead, prompts[:5], mixed) == _run(sync, prompts[:5], mixed)
    for llm in engines.values():
        _check_clean(llm)


def test_aborts_mid_run_give_the_same_outputs(engines):
    """The same calls (add, step, abort a request after some steps) on both engines: every
    output each step returns is the same (the aborted request's tokens up to its abort too)."""
    prompts = _prompts(5, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)] * 3
    seen = {}
    for ahead, llm in engines.items():
        engine, steps = llm.engine, []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"a{i}", prompt, params[i])
        count = 0
        while engine.has_unfinished_requests():
            out = engine.step()
            steps.append(sorted((o.request_id, tuple(o.outputs[0].token_ids), o.finished) for o in out))
            count += 1
            if count in (4, 9):
                engine.abort_request(f"a{count % 5}")
        seen[ahead] = [s for s in steps if s]
        _check_clean(llm)
    assert seen[True] == seen[False]


TINY_POOL = 20 * 16 * 512  # bytes: small enough that these batches preempt


def _both_orders(llama_dir, prompts: list[dict], params: list[SamplingParams], pool: int) -> tuple[dict, dict]:
    """Outputs and preemption counts of a fresh synchronous (False) and async (True) engine
    with a KV pool of ``pool`` bytes and no prefix caching."""
    outs, preemptions = {}, {}
    for ahead in (False, True):
        llm = _engine(llama_dir, kv_cache_memory=pool, async_scheduling=ahead, enable_prefix_caching=False)
        try:
            outs[ahead] = _run(llm, prompts, params)
            preemptions[ahead] = llm.engine.core.scheduler.num_preemptions
            _check_clean(llm)
        finally:
            llm.shutdown()
    return outs, preemptions


def test_preemption_under_a_tiny_pool(llama_dir):
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, max_tokens=50, ignore_eos=True)] * 4
    outs, preemptions = _both_orders(llama_dir, _prompts(8, seed=2), params, TINY_POOL)
    assert preemptions[True] > 0
    assert outs[True] == outs[False]


def test_greedy_ids_handed_over_on_the_device(llama_dir, monkeypatch):
    """The CUDA path of steps of plain tokens (greedy or sampled), run here on CPU: their ids stay in a tensor
    (``DeviceTokens``), the next step's placeholder rows are gathered from it and the engine core
    reads the ids only when it applies the step; outputs are the synchronous engine's, with
    steps that sample otherwise in between and with preemption (a tiny pool)."""
    from pagoda.executor import model_runner

    monkeypatch.setattr(async_scheduling, "DEFER_IDS_ON", ("cuda", "cpu"))
    handed: list[int] = []

    class Counted(model_runner.DeviceTokens):
        def __init__(self, tokens, seq_ids):
            handed.append(len(seq_ids))
            super().__init__(tokens, seq_ids)

    monkeypatch.setattr(model_runner, "DeviceTokens", Counted)
    # Sampler.tokens runs inside every general-path call and alone on a deferred sampled step.
    calls = {"tokens": 0, "__call__": 0}
    for name in calls:
        real = getattr(model_runner.Sampler, name)
        monkeypatch.setattr(model_runner.Sampler, name,
                            lambda self, *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                            or _real(self, *a))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 17, 33, 25, 52, 9)] + \
        [SamplingParams(temperature=0.8, seed=2, max_tokens=20, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=30, logprobs=1)]
    outs, preemptions = _both_orders(llama_dir, _prompts(8, seed=6), params, TINY_POOL)
    assert outs[True] == outs[False]
    assert len(handed) > 10  # every step without the logprob request
    assert 0 < calls["tokens"] - calls["__call__"] < len(handed)  # steps with the seeded sampled row too
    assert preemptions[True] > 0


def test_steps_that_need_the_host_run_synchronously(engines):
    """A step with a sequence whose next sampling reads its output tokens (penalties, a pending
    min_tokens), a prompt forking into samples or prompt logprobs is not run ahead of."""
    ahead = engines[True]
    core = ahead.engine.core
    seen: list[bool] = []
    real = core._collect

    def spy(flight):
        seen.append(async_scheduling.runs_ahead(flight.sched) or not flight.sched.scheduled)
        assert all(PLACEHOLDER_TOKEN not in item.seq.token_ids[:item.start] for item in flight.sched.scheduled)
        return real(flight)

    core._collect = spy
    try:
        _run(ahead, _prompts(1, seed=1), [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2)])
        assert seen and not any(seen)
        seen.clear()
        _run(ahead, _prompts(1, seed=1), [SamplingParams(temperature=0, max_tokens=8, min_tokens=5)])
        assert seen[:5] == [False] * 5 and any(seen[5:])
    finally:
        del core._collect


def test_flag_checks(llama_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), async_scheduling=True, num_scheduler_steps=4))
    cfg = EngineConfig.from_args(EngineArgs(model=str(llama_dir), async_scheduling=True))
    assert cfg.scheduler.async_scheduling and cfg.scheduler.num_scheduler_steps == 1


def test_tensor_parallel_engine_schedules_ahead(llama_dir):
    """Two tensor-parallel ranks (gloo on CPU): the async engine's outputs are the synchronous
    TP engine's, and it really ran ahead (placeholders filled on the host, shipped to rank 1)."""
    from pagoda.executor.tp_executor import TPExecutor

    prompts = _prompts(5, seed=8)
    params = [p for p in _params(0) if p.n == 1][:5]
    outs = {}
    for ahead in (False, True):
        llm = _engine(llama_dir, kv_cache_memory=16 << 20, tensor_parallel_size=2, async_scheduling=ahead)
        try:
            core = llm.engine.core
            assert isinstance(core.executor, TPExecutor)
            assert (core._pipeline is not None) == ahead
            calls = _count_ahead(llm)
            outs[ahead] = _run(llm, prompts, params)
            assert (calls[0] > 10) == ahead
            _check_clean(llm)
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]
