"""``Dashboard.state`` over a given engine snapshot (no server), and ``pagoda top``'s frame of it:
ages and usage derived, previews decoded only where allowed, the frame cut to the terminal and
free of the prompt's control characters."""
from __future__ import annotations

import asyncio
import time

from pagoda.engine.snapshot import EngineSnapshot, PrefixSnapshot, RequestSnapshot
from pagoda.entrypoints.openai.dashboard.history import DashboardHistory
from pagoda.entrypoints.openai.dashboard.routes import Dashboard
from pagoda.entrypoints.top import render


class Engine:
    """What ``Dashboard`` uses of ``AsyncEngine``: one canned snapshot, counted calls."""

    engine_pid = 42

    def __init__(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        self.calls = 0

    async def call_utility(self, method: str, timeout: float = 10.0) -> EngineSnapshot:
        assert method == "snapshot"
        self.calls += 1
        return self.snapshot

    def detokenize(self, ids: list[int]) -> str:
        return "line one\nred \x1b[31mtext"


def snapshot(num_requests: int) -> EngineSnapshot:
    now = time.time()
    requests = [RequestSnapshot(f"req-{i}", "running" if i < 2 else "waiting", now - 3.0 - i, 20, 10, 5)
                for i in range(num_requests)]
    prefixes = [PrefixSnapshot("aaaa000011112222", 32, 9, True, preview_token_ids=[1, 2, 3]),
                PrefixSnapshot("bbbb000011112222", 16, 4, salted=True)]
    return EngineSnapshot(time=now, num_running=2, num_waiting=num_requests - 2, requests=requests, num_blocks=100,
                          block_size=16, num_free_blocks=60, num_cached_blocks=15, num_used_blocks=25,
                          prefixes=prefixes, device="cpu", device_name="Test CPU",
                          kernel={"level": "avx2", "variant": "avx2", "reason": "test", "gemm": "auto"},
                          by_priority={"running": {"0": 2}, "waiting": {"0": num_requests - 2}},
                          by_adapter={"running": {"": 2}, "waiting": {"": num_requests - 2}})


def test_state_derives_ages_usage_and_previews() -> None:
    engine = Engine(snapshot(5))
    dash = Dashboard(engine, "m", DashboardHistory())  # type: ignore[arg-type]

    async def two_reads() -> tuple[dict, dict]:
        return await dash.state(), await dash.state()

    state, again = asyncio.run(two_reads())
    assert engine.calls == 1  # two reads within MIN_SNAPSHOT_INTERVAL_S share one engine call
    e = state["engine"]
    assert e["kv_cache_usage"] == 0.25
    assert all(r["age_s"] >= 3.0 for r in e["requests"])
    assert e["prefixes"][0]["preview"].startswith("line one") and e["prefixes"][1]["preview"] is None
    assert "preview_token_ids" not in e["prefixes"][0]
    assert state["server"] == {**state["server"], "model": "m", "engine_pid": 42, "text_hidden": False}


def test_top_frame_fits_the_terminal_and_escapes_control_characters() -> None:
    state = asyncio.run(Dashboard(Engine(snapshot(40)), "m", DashboardHistory()).state())  # type: ignore[arg-type]
    frame = render(state, width=90, height=24)
    lines = frame.splitlines()
    assert all(len(line) <= 90 for line in lines)
    assert "\x1b" not in frame and "\\x1b[31m" in frame and "\\n" in frame
    assert "(private: salted)" in frame
    assert "running 2  waiting 38" in frame and "... and " in frame
    assert len(lines) <= 24
    full = render(state)  # --once: every listed request
    assert all(f"req-{i} " in full for i in range(40))
