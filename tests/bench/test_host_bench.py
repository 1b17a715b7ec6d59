"""``pagoda bench host``: the engine's host work per decode step with the forward pass stubbed
out, on the heap as collected and as frozen."""
from __future__ import annotations

import gc
import json

from pagoda.entrypoints.cli import main


def test_host_bench_times_the_engine_without_the_model(tmp_path, capsys):
    # As in the ``pagoda bench host`` process: nothing frozen before (the suite's conftest
    # freezes the heap at each test file's start; this thaws it for the file's tests).
    gc.unfreeze()
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batches", "1,4", "--steps", "6", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    for heap in ("collected", "frozen"):
        rows = data[heap]
        assert [r["batch"] for r in rows] == [1, 4]
        for r in rows:
            # Zero logits: every greedy token is 0, so the stub, not a model, produced them.
            assert r["tokens"] == [0] and r["steps"] >= 5
            assert r["median_step_us"] > 0 and r["us_per_sequence_step"] * r["batch"] == r["median_step_us"]
            assert r["full_collections"] >= 0 and r["full_collection_ms"] >= 0
    assert gc.get_freeze_count() == 0  # the bench thawed what it froze
    printed = capsys.readouterr().out
    assert "us a sequence step" in printed and "frozen" in printed


def test_full_collections_are_counted():
    from pagoda.bench.host import FullCollections

    with FullCollections() as watch:
        gc.collect()  # before switching on: not counted
        watch.on = True
        gc.collect()
    gc.collect()  # after leaving: not counted
    assert len(watch.pauses) == 1 and watch.pauses[0] >= 0


def test_gc_freeze_switch(monkeypatch):
    from pagoda.engine import gc_freeze

    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    for off in ("0", "off", " False "):
        monkeypatch.setenv(gc_freeze.ENV, off)
        assert gc_freeze.freeze() is False and calls == []
    monkeypatch.delenv(gc_freeze.ENV)
    assert gc_freeze.freeze() is True and calls == ["freeze"]


def test_a_callers_frozen_heap_stays_frozen():
    """Python thaws all or nothing: called where objects were frozen already, the bench leaves
    the freeze as it found it (and its own objects with it) rather than thawing the caller's."""
    from pagoda.bench import host

    gc.freeze()
    before = gc.get_freeze_count()
    host.measure([1], steps=3)
    assert gc.get_freeze_count() >= before > 0
