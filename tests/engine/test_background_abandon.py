"""Abandoned background steps (``EngineCore.abandon_background_when``): a step made only of
batch rows is given up between decoder layers when interactive work arrives; it yields nothing,
and the batch lines still end with the very tokens they have alone (greedy, and seeded sampling,
whose generators an abandoned step must not move). The arrival is scripted: it "happens" at a
chosen check, so nothing here depends on timing."""
from __future__ import annotations

import msgspec
import pytest
import zmq

from pagoda import LLM, SamplingParams
from pagoda.engine.core_proc import EngineCoreProc
from pagoda.engine.messages import AbortRequest, AddRequestMsg, EngineCoreRequest

PROMPTS = [{"prompt_token_ids": [11 + 3 * i] * (6 + 2 * i)} for i in range(3)]
PARAMS = {"greedy": SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
          "seeded": SamplingParams(max_tokens=14, temperature=0.9, seed=7, ignore_eos=True)}


@pytest.fixture(scope="module")
def llm(llama_dir):
    # Rounds of up to 4 decode steps, fixed, so a round's further steps are always there to give up.
    made = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=256, num_scheduler_steps=4)
    yield made
    made.shutdown()


class Arrival:
    """The abandon check: an interactive request "arrives" at the ``at``-th check after ``arm``."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.calls = 0

    def arm(self, at: int | None) -> None:
        self.at, self.calls = at, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.at is not None and self.calls >= self.at


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_background_steps_given_up_mid_forward_lose_nothing(llm, kind):
    params = PARAMS[kind]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    engine, core = llm.engine, llm.engine.core
    arrival = Arrival()
    produced: dict[str, list[int]] = {}
    final: dict[str, list[int]] = {}

    def step() -> int:
        """One engine step; the tokens the batch lines got in it."""
        got = 0
        for out in engine.step():
            if out.request_id.startswith("bg-"):
                got += len(out.outputs[0].token_ids) - len(produced.get(out.request_id, []))
            produced[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
        return got

    core.abandon_background_when(arrival)
    before = core.num_abandoned_steps
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"bg-{i}", prompt, params, background=True)
        arrival.arm(3)  # after the prompts' first layer: the prefill is given up
        assert step() == 0 and core.num_abandoned_steps == before + 1
        arrival.arm(None)
        assert step() > 0  # the prompts again, whole this time
        arrival.arm(3)  # a round's first decode step, after its first layer
        assert step() == 0 and core.num_abandoned_steps == before + 2
        arrival.arm(5)  # the round's second step, mid-forward: the first step's tokens stay
        assert step() == len(PROMPTS) and core.num_abandoned_steps == before + 2
        arrival.arm(None)
        engine.add_request("chat", {"prompt_token_ids": [3, 4, 5, 6]}, PARAMS["greedy"])  # what arrived
        while engine.has_unfinished_requests():
            step()
    finally:
        core.abandon_background_when(None)
    assert len(final["chat"]) == PARAMS["greedy"].max_tokens
    assert [final[f"bg-{i}"] for i in range(len(PROMPTS))] == alone


def test_interactive_steps_are_never_given_up(llm):
    """Only background-only steps ask the check: an interactive row in the step runs whole."""
    params = PARAMS["greedy"]
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    core = llm.engine.core
    arrival = Arrival()
    arrival.arm(1)
    core.abandon_background_when(arrival)
    try:
        got = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        core.abandon_background_when(None)
    assert got == alone and arrival.calls == 0


def test_the_engine_process_sees_an_interactive_request_on_its_socket_mid_step(llm):
    """``EngineCoreProc.interactive_arrived`` reads the waiting messages (a batch line does not
    count, an interactive request does) and keeps them for the loop, which adds them in order."""
    core = llm.engine.core
    ctx = zmq.Context()
    inp, out, sender, receiver = (ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH),
                                  ctx.socket(zmq.PULL))
    encoder = msgspec.msgpack.Encoder()

    def send(request_id: str, background: bool) -> None:
        request = EngineCoreRequest(request_id, [5, 6, 7], PARAMS["greedy"], 0.0, background=background)
        sender.send(encoder.encode(AddRequestMsg(request)))

    try:
        port = inp.bind_to_random_port("tcp://127.0.0.1")
        out.connect(f"tcp://127.0.0.1:{receiver.bind_to_random_port('tcp://127.0.0.1')}")
        sender.connect(f"tcp://127.0.0.1:{port}")
        proc = EngineCoreProc(core, inp, out, parent_pid=-1)
        assert not proc.interactive_arrived()
        send("line", background=True)
        assert inp.poll(2000)
        assert not proc.interactive_arrived() and proc.input_waiting()  # read, kept, not interactive
        send("chat", background=False)
        assert inp.poll(2000)
        assert proc.interactive_arrived()
        proc._receive(block=False)
        assert list(core.scheduler.requests) == ["line", "chat"] and not proc.input_waiting()
    finally:
        for request_id in ("line", "chat"):
            core.abort(AbortRequest(request_id))
        for sock in (inp, out, sender, receiver):
            sock.close(linger=0)
        ctx.term()

