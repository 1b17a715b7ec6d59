"""Multi-step decoding (``num_scheduler_steps``): a round of decode steps per schedule gives the
very same tokens, finish reasons and logprob-free outputs as one step per schedule, stops where
each request stops, frees every block, and is chosen automatically from the step time."""
from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import AUTO_MAX_STEPS, AUTO_STEPS_BURST_S, EngineArgs, EngineConfig
from pagoda.request import Request
from tests.scheduler.test_scheduler import make_scheduler
from pagoda.step import ModelOutput, SeqStepResult


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(rng.randint(3, 40))]} for _ in range(n)]


def _params(eos: int) -> list[SamplingParams]:
    """Greedy and sampled requests; lengths that are not multiples of a round; stops by EOS (the
    tiny model's greedy tokens include ``eos``) and by stop ids; a min_tokens that holds EOS back."""
    return [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=29),
        SamplingParams(temperature=0, max_tokens=41, stop_token_ids=[eos]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=19),
        SamplingParams(temperature=0, max_tokens=25, min_tokens=9),
    ]


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


@pytest.fixture(scope="module")
def engines(llama_dir):
    made = {steps: LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=256, num_scheduler_steps=steps)
            for steps in (1, 5)}
    yield made
    for llm in made.values():
        llm.shutdown()


def _common_token(llm: LLM, prompt: dict) -> int:
    """A token the greedy continuation of ``prompt`` produces (used as an EOS / stop id)."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids[6]


def test_rounds_give_the_same_outputs_as_single_steps(engines):
    single, multi = engines[1], engines[5]
    prompts = _prompts(6, seed=3)
    stop = _common_token(single, prompts[2])
    params = _params(stop)
    expected = _run(single, prompts, params)
    got = _run(multi, prompts, params)
    assert got == expected
    # The stop id really ended request 2 early, mid-round, and min_tokens held request 5.
    assert expected[2][1] == "stop" and expected[2][2] == stop and len(expected[2][0]) < 41
    assert len(expected[5][0]) >= 9
    # Alone (batch 1, the fast greedy path) and among others, each request's tokens agree.
    for i in (0, 1, 2, 5):
        assert _run(multi, [prompts[i]], [params[i]]) == [expected[i]]
    for llm in engines.values():
        assert not llm.engine.core.scheduler.running
        llm.engine.core.kv.check_invariants([])  # every block free or held by the prefix cache only


def test_rounds_really_run_several_steps_per_schedule(engines):
    multi = engines[5]
    core = multi.engine.core
    seen = []
    schedule = core.scheduler.schedule

    def spy(drafts=None, num_steps=1):
        out = schedule(drafts, num_steps)
        seen.append([item.num_lookahead for item in out.scheduled])
        return out

    core.scheduler.schedule = spy
    try:
        params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
        engine = multi.engine
        engine.add_request("r", _prompts(1, seed=9)[0], params)
        steps, tokens = 0, []
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                tokens = out.outputs[0].token_ids
    finally:
        core.scheduler.schedule = schedule
    assert len(tokens) == 23
    # The prompt step, then rounds of 1 + 4 steps (the last one shortened to max_tokens).
    assert [x for x in seen if x] == [[0], [4], [4], [4], [4], [1]]
    assert steps == 6


def test_lookahead_only_for_plain_decodes_with_nothing_waiting():
    s = make_scheduler(num_blocks=64, budget=64, block=4)

    def add(rid, **kw):
        s.add_request(Request(rid, list(range(5)), SamplingParams(max_tokens=30, ignore_eos=True, **kw), (0,)))

    def step(num_steps):
        out = s.schedule(None, num_steps)
        results = ModelOutput()
        for item in out.scheduled:
            if item.samples:
                last = item.seq.token_ids[-1]
                results.results[item.seq.seq_id] = SeqStepResult([last + 1 + j for j in range(1 + item.num_lookahead)])
        s.update(out, results)
        return out

    add("a", temperature=0)
    assert [i.num_lookahead for i in step(4).scheduled] == [0]  # its prompt
    out = step(4)
    assert [i.num_lookahead for i in out.scheduled] == [3]
    seq = out.scheduled[0].seq
    assert seq.num_tokens == 5 + 1 + 4 and seq.num_computed_tokens == seq.num_tokens - 1
    assert seq.token_ids[5:] == [5, 6, 7, 8, 9]
    add("b", temperature=0, logprobs=2)  # waiting: this round is a single step (admits it)
    assert [i.num_lookahead for i in step(4).scheduled] == [0, 0]
    assert [i.num_lookahead for i in step(4).scheduled] == [0, 0]  # b wants logprobs: no lookahead
    s.abort_request("b")
    for kw in ({"presence_penalty": 0.5}, {"min_tokens": 20}):
        add("c", **kw)
        step(4)
        assert [i.num_lookahead for i in step(4).scheduled] == [0, 0]
        s.abort_request("c")
    # The round stops at max_tokens: a has 30 - produced tokens left.
    while True:
        out = step(4)
        if not out.scheduled:
            break
        left = 30 - (seq.num_output_tokens - 1 - out.scheduled[0].num_lookahead)
        assert out.scheduled[0].num_lookahead <= max(left - 1, 0)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 30
    s.kv.check_invariants([])


def test_lookahead_never_preempts():
    s = make_scheduler(num_blocks=3, budget=64, block=4)
    s.add_request(Request("a", list(range(7)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), (0,)))
    out = s.schedule(None, 8)
    s.update(out, ModelOutput({out.scheduled[0].seq.seq_id: SeqStepResult([7])}))
    out = s.schedule(None, 8)  # 8 more tokens would need a fourth block: a single step instead
    assert [i.num_lookahead for i in out.scheduled] == [0] and not out.preempted


def test_auto_steps_follow_the_decode_step_time(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=256)
    try:
        core = llm.engine.core
        assert core.num_steps() == 1  # nothing timed yet
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert core.decode_step_s is not None and core.decode_step_s > 0
        expected = max(1, min(AUTO_MAX_STEPS, int(AUTO_STEPS_BURST_S / core.decode_step_s)))
        assert core.num_steps() == expected
        core.decode_step_s = AUTO_STEPS_BURST_S / 3.5
        assert core.num_steps() == 3
        core.decode_step_s = 1.0
        assert core.num_steps() == 1
        core.decode_step_s = 1e-9
        assert core.num_steps() == AUTO_MAX_STEPS
    finally:
        llm.shutdown()


def test_no_rounds_with_speculative_decoding(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=256, num_scheduler_steps=4,
              speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        assert llm.engine.core.num_steps() == 1  # drafts are verified one step at a time
    finally:
        llm.shutdown()


@pytest.mark.parametrize("bad", [0, -2])
def test_num_scheduler_steps_must_be_positive(llama_dir, bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), num_scheduler_steps=bad))


def test_a_sampling_fault_mid_round_ends_only_its_request(engines, monkeypatch):
    """Rounds of five steps; one greedy row's sampling fails from its third token on (inside a
    round): that request ends with exactly the three tokens it had, everyone else (seeded
    samples included) gets the tokens of a clean run, and every block comes back."""
    from tests.engine.test_isolation import (GREEDY, POISON_PROMPT, clean_batch, inject_sampler_fault,
                                             poison_from_third_token, run)

    core = engines[5].engine.core
    expected, errors = run(core, clean_batch())
    assert not errors
    calls = []

    def fault(rows):
        calls.append(1)
        poison_from_third_token(rows)

    inject_sampler_fault(monkeypatch, fault)
    tokens, errors = run(core, {**clean_batch(), "bad": (POISON_PROMPT, GREEDY)})
    assert set(errors) == {"bad"} and "injected sampler fault" in errors["bad"].message
    assert len(tokens[("bad", 0)]) == 3
    assert {k: v for k, v in tokens.items() if k[0] != "bad"} == expected
    assert calls  # the general sampling path ran (seeded rows keep the batch off the greedy loop)


@pytest.mark.parametrize("kw", [dict(dtype="bfloat16"), dict(quantization="int8"),
                                dict(quantization="int4", quantization_config='{"lm_head": true, "group_size": 32}')],
                         ids=["bf16", "int8", "int4-head"])
def test_greedy_rounds_on_the_lean_decode_step_match_single_steps(llama_dir, kw):
    """The multi-step greedy loop runs the runner's lean decode step (token lookup, fused
    layers, LM head, no module plumbing): the same tokens as single steps, in every precision."""
    prompts = _prompts(3, seed=21)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = {}
    for steps in (1, 6):
        llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=256, num_scheduler_steps=steps, **kw)
        try:
            runner = llm.engine.core.executor
            assert runner.decode_step is not None
            calls = []
            lean = runner.decode_step

            def counted(inputs, *rows, lean=lean):
                calls.append(len(rows))
                return lean(inputs, *rows)

            runner.decode_step = counted
            outs[steps] = _run(llm, prompts, [params] * 3) + _run(llm, prompts[:1], [params])
            assert (len(calls) > 0) == (steps > 1)
            # Every step, a round's first too, takes the embedding rows the round wrote.
            assert steps == 1 or calls.count(1) == len(calls)
        finally:
            llm.shutdown()
    assert outs[6] == outs[1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=4, max_tokens=23, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_round_ends_when_work_arrives(engines, params):
    """``interrupt_rounds_when``: once it reports work (a request or abort on the server's socket),
    the round stops after the step in hand, and the next round goes on; the tokens are those of
    single steps."""
    single, multi = engines[1], engines[5]
    prompt = _prompts(1, seed=13)
    expected = _run(single, prompt, [params])
    core = multi.engine.core
    asked = []

    def arrived() -> bool:  # work turns up while the second step of every round runs
        asked.append(1)
        return len(asked) % 2 == 0

    produced = []
    update = core.scheduler.update

    def spy(sched, result):
        produced.append(max((len(r.token_ids) for r in result.results.values()), default=0))
        return update(sched, result)

    core.interrupt_rounds_when(arrived)
    core.scheduler.update = spy
    try:
        got = _run(multi, prompt, [params])
    finally:
        core.interrupt_rounds_when(None)
        core.scheduler.update = update
    assert got == expected
    # The prompt step gives one token; then every round of 1 + 4 planned steps stops after 2.
    assert produced[0] == 1 and set(produced[1:-1]) == {2}
    assert sum(produced) == 23


def test_the_server_engine_interrupts_rounds_on_its_input_socket(llama_dir, monkeypatch):
    """The engine-core process asks its input socket between a round's steps, while it runs."""
    import zmq

    from pagoda.engine.core import EngineCore
    from pagoda.engine.core_proc import EngineCoreProc

    core = EngineCore(EngineConfig.from_args(EngineArgs(model=str(llama_dir), kv_cache_memory=8 << 20,
                                                        max_model_len=128)))
    installed = []
    interrupt_rounds_when = core.interrupt_rounds_when

    def spy(arrived):
        installed.append(arrived)
        interrupt_rounds_when(arrived)
        installed.append(core.executor.round_interrupt)

    monkeypatch.setattr(core, "interrupt_rounds_when", spy)
    ctx = zmq.Context()
    inp, out, sender, receiver = (ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH),
                                  ctx.socket(zmq.PULL))
    try:
        port = inp.bind_to_random_port("tcp://127.0.0.1")
        out.connect(f"tcp://127.0.0.1:{receiver.bind_to_random_port('tcp://127.0.0.1')}")
        proc = EngineCoreProc(core, inp, out, parent_pid=-1)  # no parent: run() ends at once
        assert not proc.input_waiting()
        sender.connect(f"tcp://127.0.0.1:{port}")
        sender.send(b"x")
        assert inp.poll(2000)  # delivered
        assert proc.input_waiting()
        assert proc.run() == 0
        # Installed on the runner for the loop, taken off when the loop ends.
        assert installed == [proc.input_waiting, proc.input_waiting, None, None]
    finally:
        for sock in (inp, out, sender, receiver):
            sock.close(linger=0)
        ctx.term()
        core.shutdown()


def test_greedy_rounds_through_the_decode_graphs_match_single_steps(llama_dir):
    """On a GPU a greedy round runs through the decode graphs, each step's argmax fed to the next
    on the device and read once at the round's end (``DecodeGraphs.greedy_round``). The same code
    on CPU through the static buffers (no capture): the tokens, finish and stop reasons of single
    steps, with EOS and stop ids mid-round, rounds cut short by arriving work, and a batch with a
    sampled request (no device round then); every block freed."""
    from pagoda.executor.cuda_graphs import DecodeGraphs

    kw = dict(kv_cache_memory=16 << 20, max_model_len=256, max_num_seqs=6, device="cpu")
    single = LLM(str(llama_dir), num_scheduler_steps=1, **kw)
    prompts = _prompts(5, seed=17)
    stop = _common_token(single, prompts[1])
    greedy = [SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=29, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=41),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, min_tokens=9)]
    mixed = greedy[:4] + [SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)]
    expected = [_run(single, prompts, greedy), _run(single, prompts[:1], greedy[:1]), _run(single, prompts, mixed)]
    single.shutdown()
    assert expected[0][1][1] == "stop" and len(expected[0][1][0]) < 29  # the stop id ended it early

    multi = LLM(str(llama_dir), num_scheduler_steps=6, **kw)
    try:
        runner, core = multi.engine.core.executor, multi.engine.core
        graphs = runner.decode_graphs = DecodeGraphs(runner, use_graphs=False)
        lengths = []
        round_ = graphs.greedy_round

        def spy(inputs, steps, ends, stop=None):
            rows = round_(inputs, steps, ends, stop)
            lengths.append(max(len(r) for r in rows))
            return rows

        graphs.greedy_round = spy
        assert _run(multi, prompts, greedy) == expected[0]
        assert graphs.rounds > 0 and max(lengths) == 6  # whole rounds of 1 + 5 steps ran
        assert _run(multi, prompts[:1], greedy[:1]) == expected[1]
        rounds = graphs.rounds
        assert _run(multi, prompts, mixed) == expected[2]
        assert graphs.rounds > rounds  # once the sampled request ended, the greedy rest ran rounds
        asked = []
        core.interrupt_rounds_when(lambda: asked.append(1) or len(asked) % 2 == 0)  # work every other step
        lengths.clear()
        assert _run(multi, prompts, greedy) == expected[0]
        assert lengths and max(lengths) == 2
        core.interrupt_rounds_when(None)
        assert not core.scheduler.running
        core.kv.check_invariants([])
    finally:
        multi.shutdown()
