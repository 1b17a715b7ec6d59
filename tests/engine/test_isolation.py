"""Per-request fault isolation in the engine core: a request whose own work fails (hostile
values that slipped past the front end, a fault in the sampler, a failing update) ends alone
with an error; everyone else in the same steps gets exactly the tokens of a clean run, the
engine keeps serving and every KV block comes back."""
from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import zmq

import pagoda.executor.sampler as sampler_mod
from pagoda import SamplingParams
from pagoda.engine.core import EngineCore
from pagoda.engine.core_proc import EngineCoreProc
from pagoda.engine.messages import (AddRequestMsg, CoreOutputMsg, EngineCoreRequest, OutputsMsg, ReadyMsg,
                                    RequestError)
from pagoda.executor.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
POISON_PROMPT = [7, 7, 7, 7, 7]


def inject_sampler_fault(monkeypatch, fault) -> None:
    """``fault(rows)`` runs (and may raise) at the start of every sampler call: in
    ``Sampler.sample_from``, every row's way in, except a step of plain greedy rows only, which
    ``ModelRunner._sample_plain`` hands to ``Sampler.greedy`` without building sampler rows;
    there it runs in ``Sampler.greedy`` (inside the fast path, whose failure sends the step down
    the general path) with the rows the step would have built."""
    real = sampler_mod.Sampler.sample_from
    real_plain, real_greedy = ModelRunner._sample_plain, sampler_mod.Sampler.greedy
    plain_rows: list = [None]

    def faulty(self, logits, row_index, rows):
        fault(rows)
        return real(self, logits, row_index, rows)

    def faulty_plain(self, plan, logits, produced):
        plain_rows[0] = [sampler_mod.sample_row(e.item.seq, sampler_mod.SeedGenerators(),
                                                drafts=produced.get(e.item.seq.seq_id, ()))
                         for e in plan.entries if e.sample_row is not None]
        try:
            return real_plain(self, plan, logits, produced)
        finally:
            plain_rows[0] = None

    def faulty_greedy(logits, row_index):
        if plain_rows[0] is not None:  # (from sample_from, the rows have met the fault already)
            fault(plain_rows[0])
        return real_greedy(logits, row_index)

    monkeypatch.setattr(sampler_mod.Sampler, "sample_from", faulty)
    monkeypatch.setattr(ModelRunner, "_sample_plain", faulty_plain)
    monkeypatch.setattr(sampler_mod.Sampler, "greedy", staticmethod(faulty_greedy))


def poison_from_third_token(rows) -> None:
    """A sampler fault for the POISON_PROMPT row once it has three output tokens."""
    if any(r.prompt_token_ids == POISON_PROMPT and len(r.output_token_ids) >= 3 for r in rows):
        raise RuntimeError("injected sampler fault")


def clean_batch() -> dict[str, tuple[list[int], SamplingParams]]:
    return {"a": ([11, 12, 13, 14], GREEDY), "b": (list(range(100, 140)), GREEDY),
            "c": ([400, 3, 99], SEEDED), "d": (list(range(200, 221)), GREEDY.clone(n=2, temperature=0.8, seed=3))}


def hostile(**values) -> SamplingParams:
    """Valid params with hostile values assigned afterwards, as a front-end slip would pass them."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for name, value in values.items():
        setattr(params, name, value)
    return params


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add everything at once, step to the end. Returns (tokens per (id, sample), errors per id)."""
    for rid, (prompt, params) in requests.items():
        core.add_request(EngineCoreRequest(rid, prompt, params, time.time()))
    tokens: dict[tuple[str, int], list[int]] = {}
    errors: dict[str, RequestError] = {}
    steps = 0
    while core.has_unfinished():
        steps += 1
        assert steps < 500
        outs = core.step()
        for out in outs.outputs:
            assert out.request_id not in errors, "a failed request must not get outputs after its error"
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        for error in outs.errors:
            assert error.request_id not in errors, "each failure is reported once"
            errors[error.request_id] = error
    assert core.kv.num_used_blocks == 0
    core.kv.check_invariants([])
    assert not core.scheduler.requests
    return tokens, errors


@pytest.fixture
def core(llama_llm) -> EngineCore:
    return llama_llm.engine.core


@pytest.fixture
def expected(core):
    tokens, errors = run(core, clean_batch())
    assert not errors
    return tokens


def assert_others_unchanged(tokens, expected, poisoned: str) -> None:
    others = {k: v for k, v in tokens.items() if k[0] != poisoned}
    assert others == expected


def test_hostile_values_are_served_not_fatal(core, expected):
    """Values that used to raise in the step (int64 overflow in torch.tensor, manual_seed
    overflow) or sample garbage are handled engine-side: the request is served normally."""
    batch = clean_batch()
    batch["x"] = (POISON_PROMPT, hostile(top_k=9223372036854775808, temperature=1.0))
    batch["y"] = (POISON_PROMPT, hostile(seed=1180591620717411303424, temperature=1.0))
    batch["z"] = (POISON_PROMPT, hostile(seed=18446744073709551615, n=2, temperature=1.0))
    batch["p"] = (POISON_PROMPT, hostile(top_p=1e-300, temperature=1.0))
    batch["r"] = (POISON_PROMPT, hostile(repetition_penalty=1e-310))
    tokens, errors = run(core, batch)
    assert not errors
    greedy, _ = run(core, {"g": (POISON_PROMPT, GREEDY)})
    # A top_p that underflows keeps only the most likely token: greedy decoding.
    assert tokens[("p", 0)] == greedy[("g", 0)]
    assert len(tokens[("z", 0)]) == len(tokens[("z", 1)]) == 12
    for rid in "xyzpr":
        del tokens[(rid, 0)]
    del tokens[("z", 1)]
    assert tokens == expected


def test_hostile_value_that_still_raises_ends_only_its_request(core, expected):
    # More logprobs than the vocabulary: topk raises inside the batched sampler.
    batch = {**clean_batch(), "bad": (POISON_PROMPT, hostile(logprobs=10**6))}
    tokens, errors = run(core, batch)
    assert set(errors) == {"bad"} and errors["bad"].status == 500
    assert "RuntimeError" in errors["bad"].message
    assert_others_unchanged(tokens, expected, "bad")
    assert run(core, clean_batch())[0] == expected  # still serving, same results


def test_sampler_fault_for_one_row_mid_decode(core, expected, monkeypatch):
    """A fault that fires for one row after a few tokens: that request ends with the tokens it
    already had; the others, seeded ones included, are exactly as in a clean run."""
    inject_sampler_fault(monkeypatch, poison_from_third_token)
    tokens, errors = run(core, {**clean_batch(), "bad": (POISON_PROMPT, GREEDY)})
    assert set(errors) == {"bad"} and "injected sampler fault" in errors["bad"].message
    assert len(tokens[("bad", 0)]) == 3
    assert_others_unchanged(tokens, expected, "bad")


def test_fault_in_one_sample_at_fork_ends_the_whole_request(core, expected, monkeypatch):
    """n = 2: sample 1's row fails at the step that forks the prompt into its samples."""
    def fault(rows):
        if any(r.generator is not None and r.generator.initial_seed() == 1001 for r in rows):
            raise RuntimeError("injected fault in sample 1")

    inject_sampler_fault(monkeypatch, fault)
    poisoned = hostile(n=2, seed=1000, temperature=1.0)
    tokens, errors = run(core, {**clean_batch(), "bad": (list(range(300, 337)), poisoned)})
    assert set(errors) == {"bad"}
    assert not any(k[0] == "bad" for k in tokens)
    assert_others_unchanged(tokens, expected, "bad")


def test_failure_in_scheduler_update_ends_only_its_request(core, expected):
    """A stop check that raises (a max_tokens of the wrong type), here for a request that
    has just forked into two samples sharing blocks."""
    poisoned = hostile(n=2, temperature=1.0, max_tokens="12")
    tokens, errors = run(core, {**clean_batch(), "bad": (list(range(300, 337)), poisoned)})
    assert set(errors) == {"bad"} and "TypeError" in errors["bad"].message
    assert_others_unchanged(tokens, expected, "bad")


def test_intake_refuses_what_would_fail_the_forward(core):
    for prompt, params in (([10**6], GREEDY), ([], GREEDY), ([1, 2], hostile(n=10**9))):
        with pytest.raises(ValueError):
            core.add_request(EngineCoreRequest("refused", prompt, params, time.time()))
        assert not core.has_unfinished() and "refused" not in core.scheduler.requests


def test_offline_generate_reports_error_and_finishes_the_batch(llama_llm, monkeypatch):
    def fault(rows):
        if any(r.prompt_token_ids == POISON_PROMPT for r in rows):
            raise RuntimeError("injected sampler fault")

    prompts = [{"prompt_token_ids": p} for p in ([11, 12, 13, 14], POISON_PROMPT, list(range(100, 140)))]
    clean = llama_llm.generate([prompts[0], prompts[2]], GREEDY, use_tqdm=False)
    inject_sampler_fault(monkeypatch, fault)
    outs = llama_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.finished for o in outs] == [True, True, True]
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in clean]
    assert llama_llm.engine.core.kv.num_used_blocks == 0


def test_engine_core_process_survives_a_failing_request(core, expected, monkeypatch, tmp_path):
    """The engine-core loop behind its sockets: a request failing in a step and one failing at
    intake are answered with errors, the loop keeps running and serves the rest."""
    def fault(rows):
        if any(r.prompt_token_ids == POISON_PROMPT for r in rows):
            raise RuntimeError("injected sampler fault")

    def broken_intake(req):
        if req.request_id == "intake":
            raise RuntimeError("injected intake fault")
        add(req)

    inject_sampler_fault(monkeypatch, fault)
    add = core.add_request
    monkeypatch.setattr(core, "add_request", broken_intake)
    # The loop shuts its core down when it ends (its process is about to exit); this core is the
    # session's shared engine, which the tests after this one still use.
    shut = []
    monkeypatch.setattr(core, "shutdown", lambda: shut.append(True))
    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind(f"ipc://{tmp_path}/in")
    from_engine.bind(f"ipc://{tmp_path}/out")
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(f"ipc://{tmp_path}/in")
    out.connect(f"ipc://{tmp_path}/out")
    proc = EngineCoreProc(core, inp, out, os.getppid())
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreOutputMsg)
    try:
        assert isinstance(decoder.decode(from_engine.recv()), ReadyMsg)
        batch = {**clean_batch(), "bad": (POISON_PROMPT, GREEDY), "dup": ([1, 2], GREEDY),
                 "intake": ([1, 2], GREEDY)}
        for rid, (prompt, params) in batch.items():
            to_engine.send(encoder.encode(AddRequestMsg(EngineCoreRequest(rid, prompt, params, time.time()))))
        to_engine.send(encoder.encode(AddRequestMsg(EngineCoreRequest("dup", [1, 2], GREEDY, time.time()))))
        tokens, errors, finished = {}, {}, set()
        want = {(rid, i) for rid in clean_batch() for i in range(clean_batch()[rid][1].n)} | {("dup", 0)}
        while not (want <= finished and {"bad", "intake", "dup"} <= set(errors)):
            assert from_engine.poll(60_000), "the engine core stopped answering"
            msg = decoder.decode(from_engine.recv())
            assert isinstance(msg, OutputsMsg)
            for o in msg.outputs.outputs:
                tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished.add((o.request_id, o.index))
            errors.update({e.request_id: e for e in msg.outputs.errors})
        assert errors["bad"].status == 500 and errors["intake"].status == 500
        assert errors["dup"].status == 400  # the second request with a live id is refused
        assert {k: v for k, v in tokens.items() if k[0] in clean_batch()} == expected
        assert thread.is_alive()
    finally:
        proc.parent_pid = -1  # the loop ends at its next turn, as when the API server is gone
        thread.join(timeout=30)
        for sock in (to_engine, from_engine, inp, out):
            sock.close(linger=0)
        ctx.term()
    assert not thread.is_alive() and shut == [True]
    assert core.kv.num_used_blocks == 0


# ---- speculative decoding ----------------------------------------------------------------------
REPEATING = [5, 6, 7, 8] * 6  # n-gram lookup always finds a proposal at the prompt's end


@pytest.fixture(scope="module")
def ngram_core(llama_dir):
    from pagoda import LLM

    llm = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    yield llm.engine.core
    llm.shutdown()


def spec_batch() -> dict[str, tuple[list[int], SamplingParams]]:
    return {"a": (REPEATING, GREEDY), "b": ([9, 10, 11, 9, 10, 11, 9, 10], GREEDY),
            "c": (list(range(100, 140)), GREEDY)}


def test_draft_verification_fault_ends_only_its_request(ngram_core, core, monkeypatch):
    import pagoda.executor.rejection as rejection

    expected, _ = run(core, spec_batch())  # speculation off: greedy outputs are the reference
    # The verification's entry into the shared sampling pipeline (penalties, min_tokens, ...).
    real = rejection.adjust_logits

    def faulty(logits, rows):
        if any(r.prompt_token_ids == POISON_PROMPT for r in rows):
            raise RuntimeError("injected verification fault")
        return real(logits, rows)

    monkeypatch.setattr(rejection, "adjust_logits", faulty)
    proposed = ngram_core.proposer.num_proposed
    tokens, errors = run(ngram_core, {**spec_batch(), "bad": (POISON_PROMPT, GREEDY)})
    assert set(errors) == {"bad"} and "injected verification fault" in errors["bad"].message
    assert_others_unchanged(tokens, expected, "bad")
    assert ngram_core.proposer.num_proposed > proposed  # the others did speculate


def test_failing_proposer_means_no_drafts(ngram_core, core, monkeypatch):
    from pagoda.spec_decode.ngram import NgramProposer

    expected, _ = run(core, spec_batch())

    def broken(self, wanted):
        raise RuntimeError("injected proposer fault")

    monkeypatch.setattr(NgramProposer, "draft", broken)
    proposed = ngram_core.proposer.num_proposed
    tokens, errors = run(ngram_core, spec_batch())
    assert not errors and tokens == expected
    assert ngram_core.proposer.num_proposed == proposed


def test_stop_for_a_preempted_sample_ends_it(llama_dir):
    """The front end finds a stop string for a sample the engine has just preempted: the abort
    with an index must take it off the waiting queue, not leave it to be recomputed."""
    from pagoda import LLM
    from pagoda.engine.messages import AbortRequest
    from pagoda.request import SeqStatus

    # 16 blocks of 16 tokens: three long-running requests cannot all fit.
    tight = LLM(str(llama_dir), kv_cache_memory=16 * 16 * 512, max_model_len=256, enable_prefix_caching=False)
    core = tight.engine.core
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    for i in range(3):
        core.add_request(EngineCoreRequest(f"r{i}", list(range(10 + i * 50, 60 + i * 50)), params, time.time()))
    while not core.scheduler.num_preemptions:
        core.step()
    victim = next(s for s in core.scheduler.waiting if s.num_output_tokens > 0)
    core.abort(AbortRequest(victim.request_id, victim.sample_index, "stop", "found"))
    assert victim.status == SeqStatus.FINISHED and victim not in core.scheduler.waiting
    while core.has_unfinished():
        outs = core.step()
        assert all(o.request_id != victim.request_id for o in outs.outputs)
    assert core.kv.num_used_blocks == 0
    tight.shutdown()
