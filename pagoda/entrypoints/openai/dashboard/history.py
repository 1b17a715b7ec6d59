"""The dashboard's memory of the last minutes: a ring of fixed-length intervals.

``DashboardHistory`` is a ``StatsListener``: it hears the same hooks as the Prometheus metrics
(engine stats with every step's outputs, tokens per output batch, finished requests), so it adds
nothing to the engine core's work. Each interval keeps its tokens, its finished requests'
time to first token and its inter-token latencies; intervals close lazily (on the next hook or
read), idle ones included, and the ring keeps ``keep_s`` seconds of them.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from pagoda.engine.messages import SchedulerStats
from pagoda.engine.output_processor import IterationStats, RequestState
from pagoda.scheduler.priority import priority_label

INTERVAL_S = 2.0
KEEP_S = 600.0
# Latencies kept per interval for its percentiles (more are dropped: the mean still counts them).
MAX_LATENCIES = 4096
# Priority classes and adapters named in the per-class figures; the rest are summed as "other".
MAX_CLASSES = 16


@dataclass
class _Interval:
    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    ttft_sum: float = 0.0
    ttft_n: int = 0
    itl_sum: float = 0.0
    itl_n: int = 0


@dataclass
class ClassFigures:
    """Finished requests of one priority class or adapter since the server started."""

    finished: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_n: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"finished": self.finished, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "ttft_mean": self.ttft_sum / self.ttft_n if self.ttft_n else None}


class DashboardHistory:
    """Per-interval samples of throughput, TTFT, ITL and the engine's gauges, plus totals."""

    def __init__(self, interval_s: float = INTERVAL_S, keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.samples: deque[dict[str, Any]] = deque(maxlen=max(1, int(keep_s / interval_s)))
        self.started = clock()
        self._cur = _Interval(self.started)
        self.stats = SchedulerStats()  # the engine's latest gauges
        self.totals = {"finished": 0, "aborted": 0, "failed": 0, "timeout": 0, "prompt_tokens": 0,
                       "generation_tokens": 0}
        self.by_priority: dict[str, ClassFigures] = {}
        self.by_adapter: dict[str, ClassFigures] = {}

    # ---- hooks (StatsListener) -------------------------------------------------------------
    def on_engine_stats(self, stats: SchedulerStats) -> None:
        self._roll()
        self.stats = stats

    def on_iteration(self, iteration: IterationStats) -> None:
        cur = self._roll()
        cur.prompt_tokens += iteration.num_prompt_tokens
        cur.generation_tokens += iteration.num_generation_tokens
        self.totals["prompt_tokens"] += iteration.num_prompt_tokens
        self.totals["generation_tokens"] += iteration.num_generation_tokens
        for seconds in iteration.inter_token_latencies:
            cur.itl_sum += seconds
            cur.itl_n += 1
            if len(cur.itl) < MAX_LATENCIES:
                cur.itl.append(seconds)

    def on_request_finished(self, state: RequestState) -> None:
        cur = self._roll()
        cur.finished += 1
        self.totals["finished"] += 1
        ttft = _ttft(state)
        if ttft is not None:
            cur.ttft_sum += ttft
            cur.ttft_n += 1
            if len(cur.ttft) < MAX_LATENCIES:
                cur.ttft.append(ttft)
        output_tokens = sum(len(s.token_ids) for s in state.samples)
        for figures, key in ((self.by_priority, priority_label(state.priority)),
                             (self.by_adapter, state.lora_name or "")):
            f = _class(figures, key)
            f.finished += 1
            f.prompt_tokens += len(state.prompt_token_ids)
            f.output_tokens += output_tokens
            if ttft is not None:
                f.ttft_sum += ttft
                f.ttft_n += 1

    def on_request_aborted(self, num_requests: int) -> None:
        self.totals["aborted"] += num_requests

    def on_request_failed(self, state: RequestState, reason: str) -> None:
        if reason in ("error", "timeout"):  # aborts are counted by on_request_aborted
            self.totals["failed" if reason == "error" else "timeout"] += 1

    # ---- reading ---------------------------------------------------------------------------
    def history(self) -> list[dict[str, Any]]:
        """The closed intervals, oldest first, then the one under way (its rates over its
        length so far)."""
        cur = self._roll()
        now = self.clock()
        return [*self.samples, self._sample(cur, max(now - cur.start, 1e-3))]

    def _roll(self) -> _Interval:
        """Close the intervals that have ended (idle ones as empty samples); the current one."""
        now = self.clock()
        cur = self._cur
        if now - cur.start >= self.interval_s * (self.samples.maxlen or 1):  # idle longer than kept
            self.samples.clear()
            cur = self._cur = _Interval(now - (now - cur.start) % self.interval_s)
        while now - cur.start >= self.interval_s:
            self.samples.append(self._sample(cur, self.interval_s))
            cur = self._cur = _Interval(cur.start + self.interval_s)
        return cur

    def _sample(self, iv: _Interval, seconds: float) -> dict[str, Any]:
        st = self.stats
        return {"t": iv.start, "dt": seconds, "prompt_tps": iv.prompt_tokens / seconds,
                "generation_tps": iv.generation_tokens / seconds, "finished": iv.finished,
                "ttft_mean": iv.ttft_sum / iv.ttft_n if iv.ttft_n else None, "ttft_p90": _p90(iv.ttft),
                "itl_mean": iv.itl_sum / iv.itl_n if iv.itl_n else None, "itl_p90": _p90(iv.itl),
                "running": st.num_running, "waiting": st.num_waiting, "kv_usage": st.kv_cache_usage}


def _ttft(state: RequestState) -> float | None:
    m = state.metrics
    if m is None or m.first_token_time is None:
        return None
    return max(0.0, m.first_token_time - m.arrival_time)


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _class(figures: dict[str, ClassFigures], key: str) -> ClassFigures:
    if key not in figures and len(figures) >= MAX_CLASSES:
        key = "other"
    return figures.setdefault(key, ClassFigures())
