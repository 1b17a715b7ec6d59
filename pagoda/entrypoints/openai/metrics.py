"""Prometheus metrics of the API server (``GET /metrics``), named as vLLM names them with a
``pagoda:`` prefix, so dashboards built for one read the other.

Every metric lives on a registry of its own (not the process-global one), so several servers
in one process (tests) do not collide. Engine-wide numbers come from the ``SchedulerStats``
the engine core sends with every step; token counts and inter-token latencies from each step's
``IterationStats``; per-request latencies from finished request states, measured with the
engine core's own timestamps, so time spent queued inside the engine shows.
To add a metric: declare it in ``ServerMetrics.__init__`` and feed it from one of the hooks.

``compat=("vllm",)`` (``pagoda serve --metrics-compat vllm``) also exposes the engine gauges under
vLLM's own names (``vllm:num_requests_waiting`` ...), for scrapers that hard-code them: the
Gateway API Inference Extension's endpoint picker, KEDA recipes, production-stack dashboards.
"""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagoda.engine.messages import SchedulerStats
from pagoda.engine.output_processor import IterationStats, RequestState
from pagoda.outputs import RequestMetrics
from pagoda.scheduler.priority import priority_label

# Seconds. Request-level phases span milliseconds (a cached prompt) to minutes (a long queue).
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                    320.0, 640.0)
# Seconds between two tokens of a stream: a GPU decode step is milliseconds, a CPU one tens.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
# Tokens in one engine step: one decode token up to a large prefill budget.
_ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Engine counters arrive as running totals; these map SchedulerStats fields to our counters
# (prometheus-client adds ``_total`` to a counter's name when it renders it).
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prefix_cache_evictions": ("pagoda:prefix_cache_evictions", "KV blocks evicted from the prefix cache."),
    "num_preemptions": ("pagoda:num_preemptions", "Sequences preempted for lack of KV blocks."),
    "num_abandoned_steps": ("pagoda:background_steps_abandoned",
                            "Steps of batch (background) rows only given up mid-forward for an interactive request."),
}
_SPEC_COUNTERS = {
    "spec_proposed": ("pagoda:spec_decode_num_draft_tokens", "Draft tokens proposed for verification."),
    "spec_accepted": ("pagoda:spec_decode_num_accepted_tokens", "Draft tokens the target model accepted."),
}

_FINISH_REASONS = ("stop", "length", "abort")

# Extra name prefixes the engine gauges may also go out under (``--metrics-compat``).
METRICS_COMPAT_CHOICES = ("vllm",)

# Per-request phases: metric name, help, the RequestMetrics fields the phase runs between.
_PHASES = (
    ("pagoda:e2e_request_latency_seconds", "Arrival to finish, per request.", "arrival_time", "finished_time"),
    ("pagoda:time_to_first_token_seconds", "Arrival to first token, per request.", "arrival_time",
     "first_token_time"),
    ("pagoda:request_queue_time_seconds", "Arrival to first scheduled (waiting in the engine), per request.",
     "arrival_time", "first_scheduled_time"),
    ("pagoda:request_prefill_time_seconds", "First scheduled to first token, per request.",
     "first_scheduled_time", "first_token_time"),
    ("pagoda:request_decode_time_seconds", "First token to finish, per request.", "first_token_time",
     "finished_time"),
)


class ServerMetrics:
    """The metric set, plus the hooks the async engine calls (``StatsListener``)."""

    def __init__(self, model_name: str, speculative: bool = False, compat: Sequence[str] = (),
                 max_loras: int | None = None, priority_classes: bool = False) -> None:
        unknown = set(compat) - set(METRICS_COMPAT_CHOICES)
        if unknown:
            raise ValueError(f"unknown metrics compat name(s): {sorted(unknown)}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # One (running, waiting, kv_usage) triple per prefix; all are set from the same stats,
        # so an alias can never disagree with the pagoda: series.
        self.gauge_sets = [self._declare_gauges(prefix) for prefix in ("pagoda", *dict.fromkeys(compat))]
        self.running, self.waiting, self.kv_usage = self.gauge_sets[0]
        self._declare_counters(speculative)
        self._declare_histograms()
        self._show_zeros()
        self.max_loras = max_loras
        # vLLM's LoRA gauge: one series whose labels list the adapters with running and waiting
        # requests (comma-separated names); its value is when that was observed.
        self.lora_info = None if max_loras is None else Gauge(
            "pagoda:lora_requests_info", "Running and waiting LoRA adapters (labels); value: observation time.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=self.registry)
        # Per tenant, while requests of more than one tenant are in the engine: the busiest few by
        # name, the rest as "other" (the engine bounds the label values, TENANT_STATS_LIMIT).
        self.tenant_requests = Gauge("pagoda:tenant_requests", "Unfinished requests per tenant (several tenants).",
                                     ["model_name", "tenant"], registry=self.registry)
        self.tenant_running = Gauge("pagoda:tenant_running_seqs", "Running sequences per tenant (several tenants).",
                                    ["model_name", "tenant"], registry=self.registry)
        # KV tiers (--kv-offload-*): blocks found (hit), written (saved) and failed reads or
        # writes (error) per tier; lookups no tier could finish (all/miss); snapshots dropped
        # on a full save queue (all/dropped); bytes and seconds of each tier's reads and writes.
        # Series appear with the first stats that carry them.
        self.kv_offload = Counter("pagoda:kv_offload_blocks", "KV blocks per tier and event (KV tiers).",
                                  ["model_name", "tier", "event"], registry=self.registry)
        self.kv_offload_bytes = Counter("pagoda:kv_offload_bytes", "Bytes read and written per KV tier.",
                                        ["model_name", "tier", "direction"], registry=self.registry)
        self.kv_offload_seconds = Counter("pagoda:kv_offload_seconds", "Time spent reading and writing per KV tier.",
                                          ["model_name", "tier", "direction"], registry=self.registry)
        self._kv_offload_last: dict[str, int] = {}
        self.priority_metrics = self._declare_priority_metrics() if priority_classes else None

    def _declare_priority_metrics(self) -> tuple[Histogram, Histogram, Counter]:
        """Per priority class (``priority_label``), under --scheduling-policy priority only."""
        labels, r = ["model_name", "priority"], self.registry
        queue = Histogram("pagoda:priority_request_queue_time_seconds", "Arrival to first scheduled, per request, "
                          "by priority class.", labels, buckets=_REQUEST_BUCKETS, registry=r)
        ttft = Histogram("pagoda:priority_time_to_first_token_seconds", "Arrival to first token, per request, "
                         "by priority class.", labels, buckets=_REQUEST_BUCKETS, registry=r)
        finished = Counter("pagoda:priority_requests", "Requests finished, by priority class and finish reason.",
                           labels + ["finished_reason"], registry=r)
        return queue, ttft, finished

    def _declare_gauges(self, prefix: str) -> tuple[Gauge, Gauge, Gauge]:
        labels, r = ["model_name"], self.registry
        running = Gauge(f"{prefix}:num_requests_running", "Sequences in the running batch.", labels, registry=r)
        waiting = Gauge(f"{prefix}:num_requests_waiting", "Sequences waiting to be scheduled.", labels, registry=r)
        kv_usage = Gauge(f"{prefix}:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels,
                         registry=r)
        return running, waiting, kv_usage

    def _declare_counters(self, speculative: bool) -> None:
        labels, r = ["model_name"], self.registry
        # The speculative counters exist only when speculation is on: a 0 would read as
        # "nothing accepted", not "not speculating".
        fields = {**_ENGINE_COUNTERS, **(_SPEC_COUNTERS if speculative else {})}
        self.engine_counters = {field: Counter(name, doc, labels, registry=r) for field, (name, doc) in fields.items()}
        self._last_totals: dict[str, int] = {field: 0 for field in fields}
        self.prompt_tokens = Counter("pagoda:prompt_tokens",
                                     "Prompt tokens of requests that got a first token (or their embedding).",
                                     labels, registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated and sent on.", labels,
                                         registry=r)
        self.request_success = Counter("pagoda:request_success", "Requests finished, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.request_aborted = Counter("pagoda:request_aborted", "Requests stopped because the client went away.",
                                       labels, registry=r)
        self.http_errors = Counter("pagoda:request_errors", "Requests refused or failed, by HTTP status.",
                                   labels + ["status"], registry=r)
        self.queue_timeouts = Counter("pagoda:request_queue_timeouts", "Requests whose deadline (--max-queue-time "
                                      "or their timeout) passed before they started (503), by priority class.",
                                      labels + ["priority"], registry=r)

    def _declare_histograms(self) -> None:
        labels, r = ["model_name"], self.registry
        self.phases = [(Histogram(name, doc, labels, buckets=_REQUEST_BUCKETS, registry=r), start, end)
                       for name, doc, start, end in _PHASES]
        self.itl = Histogram("pagoda:inter_token_latency_seconds",
                             "Time between two successive token outputs of a request (engine step times).",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        # vLLM's name for it, "_total" included, though it is a histogram.
        self.iteration_tokens = Histogram("pagoda:iteration_tokens_total",
                                          "Tokens run through the model per engine step (prefill and decode).",
                                          labels, buckets=_ITERATION_TOKEN_BUCKETS, registry=r)

    def _show_zeros(self) -> None:
        """Create the label sets known in advance, so a scrape shows 0 rather than no series
        (a rate() over a series that appears only at its first event misses that event)."""
        m = self.model_name
        histograms = [h for h, _, _ in self.phases] + [self.itl, self.iteration_tokens]
        gauges = [g for triple in self.gauge_sets for g in triple]
        for metric in (*gauges, *self.engine_counters.values(),
                       self.prompt_tokens, self.generation_tokens, self.request_aborted, *histograms):
            metric.labels(m)
        for reason in _FINISH_REASONS:
            self.request_success.labels(m, reason)

    # ---- hooks -----------------------------------------------------------------------------
    def on_engine_stats(self, stats: SchedulerStats) -> None:
        m = self.model_name
        for running, waiting, kv_usage in self.gauge_sets:
            running.labels(m).set(stats.num_running)
            waiting.labels(m).set(stats.num_waiting)
            kv_usage.labels(m).set(stats.kv_cache_usage)
        if self.lora_info is not None:
            self.lora_info.clear()
            self.lora_info.labels(",".join(sorted(stats.running_lora_adapters)),
                                  ",".join(sorted(stats.waiting_lora_adapters)),
                                  str(self.max_loras)).set_to_current_time()
        self._set_tenants(stats)
        self._count_kv_offload(stats)
        # Stats also ride on batches sent between steps (aborts), which ran no tokens.
        if stats.step_tokens > 0:
            self.iteration_tokens.labels(m).observe(stats.step_tokens)
        for name, counter in self.engine_counters.items():
            total = getattr(stats, name)
            delta, self._last_totals[name] = total - self._last_totals[name], total
            if delta > 0:  # totals only fall if the engine restarted; never count backwards
                counter.labels(m).inc(delta)

    def _count_kv_offload(self, stats: SchedulerStats) -> None:
        for key, total in stats.kv_offload.items():
            delta = total - self._kv_offload_last.get(key, 0)
            self._kv_offload_last[key] = total
            tier, _, event = key.partition("/")
            if event.endswith("_bytes"):
                counter, amount = self.kv_offload_bytes.labels(self.model_name, tier, event[:-6]), delta
            elif event.endswith("_us"):
                counter, amount = self.kv_offload_seconds.labels(self.model_name, tier, event[:-3]), delta / 1e6
            else:
                counter, amount = self.kv_offload.labels(self.model_name, tier, event), delta
            if delta > 0:
                counter.inc(amount)

    def _set_tenants(self, stats: SchedulerStats) -> None:
        for gauge, counts in ((self.tenant_requests, stats.tenant_requests),
                              (self.tenant_running, stats.tenant_running_seqs)):
            gauge.clear()
            for tenant, count in counts.items():
                gauge.labels(self.model_name, tenant).set(count)

    def on_iteration(self, iteration: IterationStats) -> None:
        m = self.model_name
        if iteration.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.labels(m).inc(iteration.num_generation_tokens)
        itl = self.itl.labels(m)
        for seconds in iteration.inter_token_latencies:
            itl.observe(seconds)

    def on_request_finished(self, state: RequestState) -> None:
        m = self.model_name
        for sample in state.samples:
            self.request_success.labels(m, sample.finish_reason or "unknown").inc()
        if state.metrics is not None:
            self._observe_phases(state.metrics)
        if self.priority_metrics is not None:
            self._observe_priority(state)

    def _observe_priority(self, state: RequestState) -> None:
        queue, ttft, finished = self.priority_metrics  # type: ignore[misc]
        label = priority_label(state.priority)
        for sample in state.samples:
            finished.labels(self.model_name, label, sample.finish_reason or "unknown").inc()
        times = state.metrics
        if times is None:
            return
        for histogram, end in ((queue, times.first_scheduled_time), (ttft, times.first_token_time)):
            if end is not None:
                histogram.labels(self.model_name, label).observe(max(0.0, end - times.arrival_time))

    def _observe_phases(self, times: RequestMetrics) -> None:
        for histogram, start_field, end_field in self.phases:
            start, end = getattr(times, start_field), getattr(times, end_field)
            if start is not None and end is not None:
                histogram.labels(self.model_name).observe(max(0.0, end - start))

    def on_request_aborted(self, num_requests: int) -> None:
        self.request_aborted.labels(self.model_name).inc(num_requests)

    def on_request_failed(self, state: RequestState, reason: str) -> None:
        if reason == "timeout":
            self.queue_timeouts.labels(self.model_name, priority_label(state.priority)).inc()

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    # ---- exposition ------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
