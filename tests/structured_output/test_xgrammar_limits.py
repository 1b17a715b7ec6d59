"""xgrammar's per-step bound: a matcher whose mask or accepted token costs more CPU than
``XGRAMMAR_STEP_CPU_S`` is stopped with ``GrammarLimitError``, as llguidance's limits stop
theirs, and offline the request fails alone with that error. The bound is set below zero here so
that every step passes it: nothing is timed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.structured_output import StructuredOutputsParams as SO
from pagoda.structured_output import backend as backend_module
from pagoda.structured_output.backend import GrammarLimitError
from pagoda.structured_output.validate import _worker_backend


@pytest.fixture(scope="module")
def xgr(llama_dir: Path):
    return _worker_backend("xgrammar", str(llama_dir), 512, [0], 64).backend


def _matchers(xgr, count: int) -> list:
    compiled = xgr.compile(SO(choice=["yes", "no"]))
    return [xgr.matcher(compiled) for _ in range(count)]


@pytest.mark.parametrize("rows", [1, 3])  # one row alone, several in xgrammar's batch call
def test_a_step_over_the_bound_stops_the_matcher(xgr, monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    matchers = _matchers(xgr, rows)
    bitmask = torch.zeros((rows, (xgr.vocab_size + 31) // 32), dtype=torch.int32)
    xgr.fill_bitmask(bitmask, [(m, i, []) for i, m in enumerate(matchers)])
    assert all(m.limit_error() is None for m in matchers)  # within the bound: untouched
    monkeypatch.setattr(backend_module, "XGRAMMAR_STEP_CPU_S", -1.0)
    xgr.fill_bitmask(bitmask, [(m, i, []) for i, m in enumerate(matchers)])
    for m in matchers:
        assert "computing a token mask took" in m.limit_error()
        with pytest.raises(GrammarLimitError, match="grammar limits"):
            m.accept(0)


def test_an_accept_over_the_bound_stops_the_matcher(xgr, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _matchers(xgr, 1)[0]
    bitmask = torch.zeros((1, (xgr.vocab_size + 31) // 32), dtype=torch.int32)
    xgr.fill_bitmask(bitmask, [(m, 0, [])])
    allowed = [t for t in range(xgr.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    monkeypatch.setattr(backend_module, "XGRAMMAR_STEP_CPU_S", -1.0)
    assert m.accept(allowed[0])  # the token itself is taken; the cost stops what follows
    assert "accepting a token took" in m.limit_error()


def test_offline_request_over_the_bound_fails_alone(llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=256, structured_outputs_backend="xgrammar")
    try:
        monkeypatch.setattr(backend_module, "XGRAMMAR_STEP_CPU_S", -1.0)
        constrained = SamplingParams(max_tokens=8, structured_outputs=SO(choice=["yes", "no"]))
        failed = llm.generate(["Answer:"], constrained, use_tqdm=False)[0].outputs[0]
        assert failed.finish_reason == "error"
        assert "(status 400)" in caplog.text and "computing a token mask took" in caplog.text  # a 400 served
        monkeypatch.setattr(backend_module, "XGRAMMAR_STEP_CPU_S", 0.25)
        plain = llm.generate(["Answer:"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(plain[0].outputs[0].token_ids) == 4  # the engine goes on
    finally:
        llm.shutdown()
