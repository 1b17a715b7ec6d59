"""``RequestTracer`` (engine/tracing.py) against real OTLP receivers, HTTP/protobuf and gRPC: the
span tree, the attributes, the events and the client's trace context. The whole server path is
tested in tests/entrypoints/test_tracing_priority_server.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.engine.messages import EngineCoreOutput
from pagoda.engine.output_processor import OutputProcessor
from pagoda.sampling_params import SamplingParams
from tests.entrypoints.otlp_receiver import GRPCReceiver, HTTPReceiver, attributes

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

from pagoda.engine.tracing import RequestTracer, resolve_protocol, trace_headers  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
ARRIVAL = 1_700_000_000.0


def finished_state(tracer: RequestTracer, traceparent: str | None):
    """A request traced from arrival to finish: queued 0.1 s, two prompt chunks, a preemption,
    three tokens, as the engine's outputs would bring them."""
    processor = OutputProcessor(None)
    params = SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9, n=1, detokenize=False)
    state = processor.add_request("cmpl-1-0", None, list(range(40)), params, ARRIVAL)
    headers = {"traceparent": traceparent} if traceparent else None
    state.trace = tracer.start("cmpl-1-0", headers, ARRIVAL, params, "sql-adapter", priority=2)
    events = [("prefill_chunk", ARRIVAL + 0.1, 8, 16), ("preempted", ARRIVAL + 0.15, 0, 0),
              ("prefill_chunk", ARRIVAL + 0.2, 24, 16)]
    outputs = [EngineCoreOutput("cmpl-1-0", 0, [7], num_cached_tokens=8, arrival_time=ARRIVAL,
                                first_scheduled_time=ARRIVAL + 0.1, first_token_time=ARRIVAL + 0.3,
                                num_preemptions=1, trace_events=events),
               EngineCoreOutput("cmpl-1-0", 0, [8, 9], finish_reason="length", num_cached_tokens=8,
                                arrival_time=ARRIVAL, first_scheduled_time=ARRIVAL + 0.1,
                                first_token_time=ARRIVAL + 0.3, finished_time=ARRIVAL + 0.5, num_preemptions=1)]
    processor.process(outputs)
    assert state.finished
    return state


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_request_span_reaches_a_real_receiver(protocol):
    receiver = HTTPReceiver() if protocol == "http/protobuf" else GRPCReceiver()
    try:
        tracer = RequestTracer(receiver.endpoint, "demo", protocol)
        state = finished_state(tracer, f"00-{TRACE_ID}-{PARENT_ID}-01")
        tracer.on_request_finished(state)
        assert state.trace is None  # ended once
        tracer.shutdown()  # flushes the batch processor
        spans = receiver.wait_for(lambda s: len(s) >= 5, timeout=30)
    finally:
        receiver.stop()
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"llm_request", "queue", "prefill", "decode", "response"}
    root = by_name["llm_request"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    for name in ("queue", "prefill", "decode", "response"):
        assert by_name[name].trace_id == root.trace_id and by_name[name].parent_span_id == root.span_id
    attrs = attributes(root)
    assert attrs["gen_ai.request.id"] == "cmpl-1-0"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "sql-adapter"
    assert attrs["pagoda.request.lora_adapter"] == "sql-adapter" and attrs["pagoda.request.priority"] == 2
    assert attrs["gen_ai.usage.prompt_tokens"] == 40 and attrs["gen_ai.usage.completion_tokens"] == 3
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 8
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.request.max_tokens"] == 3 and attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.1, abs=1e-6)
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.3, abs=1e-6)
    assert attrs["pagoda.request.num_preemptions"] == 1
    # Phases on the engine's clock.
    ns = 1e9
    assert root.start_time_unix_nano == pytest.approx(ARRIVAL * ns, abs=1e3)
    assert by_name["queue"].end_time_unix_nano == pytest.approx((ARRIVAL + 0.1) * ns, abs=1e3)
    assert by_name["prefill"].end_time_unix_nano == pytest.approx((ARRIVAL + 0.3) * ns, abs=1e3)
    assert by_name["decode"].end_time_unix_nano == pytest.approx((ARRIVAL + 0.5) * ns, abs=1e3)
    chunks = [attributes(e) for e in by_name["prefill"].events if e.name == "prefill_chunk"]
    assert chunks == [{"pagoda.chunk.start": 8, "pagoda.chunk.tokens": 16},
                      {"pagoda.chunk.start": 24, "pagoda.chunk.tokens": 16}]
    assert [e.name for e in root.events] == ["preempted"]


def test_an_unsampled_parent_is_not_traced_and_no_parent_starts_a_trace():
    receiver = HTTPReceiver()
    try:
        tracer = RequestTracer(receiver.endpoint, "demo", "http/protobuf")
        params = SamplingParams(max_tokens=1)
        assert tracer.start("r", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}, ARRIVAL, params) is None
        span = tracer.start("r2", None, ARRIVAL, params)
        assert span is not None and span.get_span_context().trace_id != int(TRACE_ID, 16)
        tracer.shutdown()
    finally:
        receiver.stop()


def test_sampler_ratio_zero_from_the_environment_traces_nothing():
    # The SDK reads OTEL_TRACES_SAMPLER when the provider is made: a fresh process sets it.
    code = ("from pagoda.engine.tracing import RequestTracer\n"
            "from pagoda.sampling_params import SamplingParams\n"
            "t = RequestTracer('http://127.0.0.1:9', 'demo', 'http/protobuf')\n"
            "print(t.start('r', None, 1.0, SamplingParams()) is None)\n")
    env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "True", out.stderr


def test_trace_headers_and_protocol_choice(monkeypatch):
    assert trace_headers({"traceparent": "x", "authorization": "k", "tracestate": "a=b"}) == {
        "traceparent": "x", "tracestate": "a=b"}
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert resolve_protocol(None) == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert resolve_protocol(None) == "http/protobuf" and resolve_protocol("grpc") == "grpc"
    with pytest.raises(ValueError):
        resolve_protocol("http/json")


def test_tracing_off_imports_no_opentelemetry_sdk():
    # (FastAPI itself imports the OpenTelemetry API; the SDK and the exporters are pagoda's to load.)
    code = ("import sys\nimport pagoda.entrypoints.openai.server, pagoda.engine.core\n"
            "print(any(m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')) for m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr
