"""Prometheus metrics of the API server (``GET /metrics``).

Every metric lives on a registry of its own (not the process-global one), so several servers
in one process (tests) do not collide. Engine-wide numbers come from the ``SchedulerStats``
the engine core sends with every step; per-request numbers from finished request states.
To add a metric: declare it in ``ServerMetrics.__init__`` and feed it from one of the hooks.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagoda.engine.messages import SchedulerStats
from pagoda.engine.output_processor import RequestState

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Engine counters arrive as running totals; these map SchedulerStats fields to our counters.
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prefix_cache_evictions": ("pagoda:prefix_cache_evictions", "KV blocks evicted from the prefix cache."),
    "num_preemptions": ("pagoda:num_preemptions", "Sequences preempted for lack of KV blocks."),
}


class ServerMetrics:
    """The metric set, plus the hooks the async engine calls (``StatsListener``)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("pagoda:num_requests_running", "Sequences in the running batch.", labels, registry=r)
        self.waiting = Gauge("pagoda:num_requests_waiting", "Sequences waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("pagoda:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels,
                              registry=r)
        self.engine_counters = {field: Counter(name, doc, labels, registry=r)
                                for field, (name, doc) in _ENGINE_COUNTERS.items()}
        self._last_totals: dict[str, int] = {field: 0 for field in _ENGINE_COUNTERS}
        self.step_tokens = Counter("pagoda:step_tokens", "Tokens run through the model (prefill and decode).",
                                   labels, registry=r)
        self.request_success = Counter("pagoda:request_success", "Requests finished, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.request_aborted = Counter("pagoda:request_aborted", "Requests stopped because the client went away.",
                                       labels, registry=r)
        self.http_errors = Counter("pagoda:request_errors", "Requests refused or failed, by HTTP status.",
                                   labels + ["status"], registry=r)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r)
        self.e2e_latency = Histogram("pagoda:e2e_request_latency_seconds", "Arrival to finish, per request.",
                                     labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pagoda:time_to_first_token_seconds", "Arrival to first token, per request.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)

    # ---- hooks -----------------------------------------------------------------------------
    def on_engine_stats(self, stats: SchedulerStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.step_tokens.labels(m).inc(stats.step_tokens)
        for name, counter in self.engine_counters.items():
            total = getattr(stats, name)
            delta, self._last_totals[name] = total - self._last_totals[name], total
            if delta > 0:  # totals only fall if the engine restarted; never count backwards
                counter.labels(m).inc(delta)

    def on_request_finished(self, state: RequestState) -> None:
        m = self.model_name
        for sample in state.samples:
            self.request_success.labels(m, sample.finish_reason or "unknown").inc()
            self.generation_tokens.labels(m).inc(len(sample.token_ids))
        self.prompt_tokens.labels(m).inc(len(state.prompt_token_ids))
        metrics = state.metrics
        if metrics is None:
            return
        if metrics.finished_time is not None:
            self.e2e_latency.labels(m).observe(max(0.0, metrics.finished_time - state.arrival_time))
        if metrics.first_token_time is not None:
            self.ttft.labels(m).observe(max(0.0, metrics.first_token_time - state.arrival_time))

    def on_request_aborted(self, num_requests: int) -> None:
        self.request_aborted.labels(self.model_name).inc(num_requests)

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    # ---- exposition ------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
