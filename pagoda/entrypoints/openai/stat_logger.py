"""The server's periodic log line: what the engine did over the last few seconds.

Fed by the same hooks as the Prometheus metrics (``StatsListener``); ``log`` writes one line
when there was work in the interval or the state changed since the last line, so an idle
server stays quiet. ``run`` calls it every ``interval_s`` seconds; ``--disable-log-stats``
turns it off.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from pagoda.engine.messages import SchedulerStats
from pagoda.engine.output_processor import IterationStats, RequestState

logger = logging.getLogger("pagoda.stats")

LOG_INTERVAL_S = 5.0


class StatLogger:
    """Accumulates one interval's tokens; compares engine totals with the last line's."""

    def __init__(self, speculative: bool = False, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.speculative = speculative
        self.interval_s = interval_s
        self.clock = clock
        self._since = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._stats = SchedulerStats()
        self._logged = SchedulerStats()  # the totals and gauges the last line showed

    # ---- hooks -----------------------------------------------------------------------------
    def on_engine_stats(self, stats: SchedulerStats) -> None:
        self._stats = stats

    def on_iteration(self, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens

    def on_request_finished(self, state: RequestState) -> None:
        pass

    def on_request_aborted(self, num_requests: int) -> None:
        pass

    def on_request_failed(self, state: RequestState, reason: str) -> None:
        pass

    # ---- the line --------------------------------------------------------------------------
    def log(self) -> str | None:
        """Log the interval since the last call; returns the line, or None if nothing moved."""
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        line = self._line(elapsed) if self._changed() else None
        if line is not None:
            logger.info("%s", line)
        self._since, self._logged = now, self._stats
        self._prompt_tokens = self._generation_tokens = 0
        return line

    def _changed(self) -> bool:
        cur, last = self._stats, self._logged
        return bool(self._prompt_tokens or self._generation_tokens or cur.num_running or cur.num_waiting
                    or (cur.num_running, cur.num_waiting, cur.kv_cache_usage, cur.num_preemptions)
                    != (last.num_running, last.num_waiting, last.kv_cache_usage, last.num_preemptions))

    def _line(self, elapsed: float) -> str:
        cur, last = self._stats, self._logged
        parts = [f"prompt throughput {self._prompt_tokens / elapsed:.1f} tokens/s",
                 f"generation throughput {self._generation_tokens / elapsed:.1f} tokens/s",
                 f"running {cur.num_running} reqs", f"waiting {cur.num_waiting} reqs",
                 f"KV cache usage {100 * cur.kv_cache_usage:.1f}%",
                 "prefix cache hit rate " + _rate(cur.prefix_cache_hits - last.prefix_cache_hits,
                                                  cur.prefix_cache_queries - last.prefix_cache_queries),
                 f"preemptions {cur.num_preemptions - last.num_preemptions}"]
        if self.speculative:
            parts.append("spec acceptance rate " + _rate(cur.spec_accepted - last.spec_accepted,
                                                         cur.spec_proposed - last.spec_proposed))
        if cur.kv_offload:
            hits = {k.split("/")[0]: v - last.kv_offload.get(k, 0) for k, v in cur.kv_offload.items()
                    if k.endswith("/hit")}
            parts.append("KV tier block hits " + " ".join(f"{tier} {n}" for tier, n in hits.items()))
        return ", ".join(parts)

    async def run(self) -> None:
        """Log every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log()


def _rate(part: int, whole: int) -> str:
    """A percentage over the interval; '-' when the interval had nothing to measure."""
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"
