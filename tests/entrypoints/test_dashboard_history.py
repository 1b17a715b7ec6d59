"""The dashboard's history ring, driven with a fake clock: tokens land in the interval they came
in, idle time becomes empty intervals, old ones fall off, and per-class figures add up."""
from __future__ import annotations

import pytest

from pagoda.engine.messages import SchedulerStats
from pagoda.engine.output_processor import IterationStats, RequestState, SampleState
from pagoda.entrypoints.openai.dashboard.history import MAX_CLASSES, DashboardHistory
from pagoda.outputs import RequestMetrics
from pagoda.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finished_state(priority: int = 0, lora: str | None = None, ttft: float = 0.5, out: int = 3) -> RequestState:
    sample = SampleState(0, None, token_ids=list(range(out)), finish_reason="length")
    metrics = RequestMetrics(arrival_time=10.0, first_token_time=10.0 + ttft)
    return RequestState("r", None, [1, 2, 3, 4], SamplingParams(), [sample], 10.0, metrics=metrics,
                        priority=priority, lora_name=lora)


def test_intervals_hold_their_own_tokens_and_latencies() -> None:
    clock = Clock()
    h = DashboardHistory(interval_s=2.0, keep_s=10.0, clock=clock)
    h.on_iteration(IterationStats(0, num_prompt_tokens=10, num_generation_tokens=4, inter_token_latencies=[0.1, 0.3]))
    h.on_engine_stats(SchedulerStats(num_running=2, kv_cache_usage=0.25))
    clock.now += 2.5
    h.on_iteration(IterationStats(0, num_generation_tokens=6))
    h.on_request_finished(finished_state(ttft=0.5))
    samples = h.history()
    assert len(samples) == 2
    first, current = samples
    assert first["prompt_tps"] == 5.0 and first["generation_tps"] == 2.0
    assert first["itl_mean"] == 0.2 and first["itl_p90"] == 0.3 and first["ttft_mean"] is None
    assert first["running"] == 2 and first["kv_usage"] == 0.25
    assert current["finished"] == 1 and current["ttft_mean"] == 0.5
    assert current["generation_tps"] == 6 / 0.5  # the interval under way: over its 0.5 s so far
    assert h.totals["prompt_tokens"] == 10 and h.totals["generation_tokens"] == 10 and h.totals["finished"] == 1


def test_idle_time_rolls_into_empty_intervals_and_the_ring_is_bounded() -> None:
    clock = Clock()
    h = DashboardHistory(interval_s=2.0, keep_s=10.0, clock=clock)
    h.on_iteration(IterationStats(0, num_generation_tokens=8))
    clock.now += 7.0
    samples = h.history()
    assert [s["generation_tps"] for s in samples] == [4.0, 0.0, 0.0, 0.0]
    clock.now += 100.0  # longer than kept: only empty intervals remain, at most keep_s of them
    samples = h.history()
    assert len(samples) <= 6 and all(s["generation_tps"] == 0.0 for s in samples)
    assert samples[-1]["t"] <= clock.now < samples[-1]["t"] + 2.0


def test_per_class_figures_and_their_bound() -> None:
    h = DashboardHistory(clock=Clock())
    h.on_request_finished(finished_state(priority=0, ttft=0.2, out=3))
    h.on_request_finished(finished_state(priority=0, lora="sql", ttft=0.4, out=5))
    h.on_request_finished(finished_state(priority=200, ttft=1.0))
    by_p = {k: v.as_dict() for k, v in h.by_priority.items()}
    assert by_p["0"]["ttft_mean"] == pytest.approx(0.3)
    assert {k: v for k, v in by_p["0"].items() if k != "ttft_mean"} == {"finished": 2, "prompt_tokens": 8,
                                                                         "output_tokens": 8}
    assert by_p[">10"]["finished"] == 1  # an out-of-range priority gets its side's label
    assert h.by_adapter["sql"].finished == 1 and h.by_adapter[""].finished == 2
    for i in range(3 * MAX_CLASSES):
        h.on_request_finished(finished_state(lora=f"a{i}"))
    assert len(h.by_adapter) <= MAX_CLASSES + 1 and h.by_adapter["other"].finished > 0
    h.on_request_aborted(2)
    h.on_request_failed(finished_state(), "abort")
    h.on_request_failed(finished_state(), "timeout")
    assert h.totals["aborted"] == 2 and h.totals["timeout"] == 1 and h.totals["failed"] == 0
