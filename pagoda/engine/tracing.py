"""OpenTelemetry request spans (``pagoda serve --otlp-traces-endpoint URL``).

The spans are made in the API server process, from facts the engine core sends back: each
``EngineCoreOutput`` carries the request's engine timestamps (first scheduled, first token,
finished, preemptions) and, for a traced request only, its scheduling events (each prefill
chunk, each preemption). Nothing crosses for untraced requests, and the OpenTelemetry SDK is
imported only when an endpoint is given: with tracing off it costs nothing.

One span per engine request (``llm_request``, a server span, the child of the client's
``traceparent`` when it sends one), started at arrival and ended when its response is done, with
child spans ``queue`` (arrival to first scheduled), ``prefill`` (to the first token; an event per
prompt chunk), ``decode`` (to the engine's finish) and ``response`` (the front end's last
detokenization and the reply), a ``preempted`` event per preemption, and the GenAI
semantic-convention attributes as vLLM sets them. Sampling follows the SDK's
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on); a
request that is not sampled is not traced in the engine either. Spans are exported in a
background thread (the SDK's batch processor), never on the event loop.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pagoda.engine.output_processor import RequestState

logger = logging.getLogger(__name__)

# The W3C trace-context headers a client may send; only these are read from a request.
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
# vLLM's default when neither the flag nor OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names one.
DEFAULT_PROTOCOL = "grpc"
PROTOCOLS = ("grpc", "http/protobuf")


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace-context headers of an HTTP request (empty when it sends none)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    if urlsplit(endpoint).path in ("", "/"):  # a collector's address: its standard traces path
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HTTPExporter(endpoint=endpoint)


def resolve_protocol(protocol: str | None) -> str:
    """The OTLP transport: the flag's, else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else grpc."""
    chosen = protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or DEFAULT_PROTOCOL
    if chosen not in PROTOCOLS:
        raise ValueError(f"the OTLP traces protocol must be one of {', '.join(PROTOCOLS)}, got {chosen!r}")
    return chosen


class RequestTracer:
    """Makes and exports the spans of engine requests; also a ``StatsListener`` of the
    ``AsyncEngine`` (it ends a request's span when the request finishes)."""

    def __init__(self, endpoint: str, model_name: str, protocol: str | None = None,
                 service_name: str = "pagoda") -> None:
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.model_name = model_name
        self.protocol = resolve_protocol(protocol)
        # A provider of our own (not the process-global one): the server's spans only, its shutdown ours.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint, self.protocol)))
        self._tracer = self._provider.get_tracer("pagoda")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()
        self._server_kind, self._error = SpanKind.SERVER, (Status, StatusCode)

    def start(self, request_id: str, headers: Mapping[str, str] | None, arrival: float, params: Any,
              lora_name: str | None = None, priority: int = 0) -> Any:
        """The span of a request that arrived at ``arrival`` (the client's trace continues when
        ``headers`` carry its ``traceparent``); None if the sampler leaves it out."""
        parent = self._propagator.extract(carrier=dict(headers or {}), getter=self._getter)
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._server_kind, start_time=_ns(arrival))
        if not span.is_recording():
            return None
        model = lora_name or self.model_name
        attributes = {"gen_ai.request.id": request_id, "gen_ai.response.id": request_id,
                      "gen_ai.request.model": model, "gen_ai.response.model": model,
                      "gen_ai.request.n": params.n, "gen_ai.request.temperature": params.temperature,
                      "gen_ai.request.top_p": params.top_p, "pagoda.request.priority": priority}
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if lora_name is not None:
            attributes["pagoda.request.lora_adapter"] = lora_name
        span.set_attributes(attributes)
        return span

    # ---- the StatsListener side ----------------------------------------------------------
    def on_engine_stats(self, stats: Any) -> None:
        pass

    def on_iteration(self, iteration: Any) -> None:
        pass

    def on_request_aborted(self, num_requests: int) -> None:
        pass

    def on_request_finished(self, state: RequestState) -> None:
        """End the request's span (if it has one) with its phases and counts."""
        span, state.trace = state.trace, None
        if span is None:
            return
        try:
            self._finish(span, state, time.time())
        except Exception:  # a tracing slip must never fail the request or the output handler
            logger.exception("tracing request %s failed", state.request_id)

    def on_request_failed(self, state: RequestState, reason: str) -> None:
        """End the span of a request that ends without finishing (aborted, failed, timed out)."""
        span, state.trace = state.trace, None
        if span is None:
            return
        status, code = self._error
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        if reason != "abort":
            span.set_status(status(code.ERROR, reason))
        span.end()

    def _finish(self, span: Any, state: RequestState, now: float) -> None:
        m = state.metrics
        assert m is not None
        prompt = len(state.prompt_token_ids)
        completion = sum(len(s.token_ids) for s in state.samples)
        span.set_attributes({
            "gen_ai.usage.prompt_tokens": prompt, "gen_ai.usage.completion_tokens": completion,
            "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion,
            "gen_ai.usage.cache_read.input_tokens": state.num_cached_tokens,
            "gen_ai.response.finish_reasons": [s.finish_reason or "unknown" for s in state.samples],
            "gen_ai.latency.e2e": now - state.arrival_time, "pagoda.request.num_preemptions": m.num_preemptions})
        scheduled, first, finished = m.first_scheduled_time, m.first_token_time, m.finished_time or now
        if scheduled is not None:
            span.set_attribute("gen_ai.latency.time_in_queue", scheduled - state.arrival_time)
            self._child(span, "queue", state.arrival_time, scheduled)
        if first is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", first - state.arrival_time)
        if scheduled is not None and first is not None:
            span.set_attribute("gen_ai.latency.time_in_model_prefill", first - scheduled)
            prefill = self._child(span, "prefill", scheduled, first, close=False)
            for name, at, start, tokens in state.trace_events:
                if name == "prefill_chunk":
                    prefill.add_event(name, {"pagoda.chunk.start": start, "pagoda.chunk.tokens": tokens}, _ns(at))
            prefill.end(_ns(first))
            span.set_attribute("gen_ai.latency.time_in_model_decode", finished - first)
            self._child(span, "decode", first, finished)
        for name, at, _, _ in state.trace_events:
            if name == "preempted":
                span.add_event(name, timestamp=_ns(at))
        self._child(span, "response", min(finished, now), now)
        span.end(_ns(now))

    def _child(self, parent: Any, name: str, start: float, end: float, close: bool = True) -> Any:
        from opentelemetry.trace import set_span_in_context

        child = self._tracer.start_span(name, context=set_span_in_context(parent), start_time=_ns(start))
        if close:
            child.end(_ns(max(start, end)))
        return child

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        self._provider.shutdown()
