"""One ``pagoda serve`` with --scheduling-policy priority and --otlp-traces-endpoint (OTLP/HTTP to a
real receiver started here): a traced request's span tree under the client's traceparent, its
token counts and prefill chunks; the 400 and 503 shapes of priority and deadlines; the finish
reason of a request whose deadline passes while it runs; the per-priority metrics."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.entrypoints.otlp_receiver import HTTPReceiver, attributes
from tests.entrypoints.server_helpers import ServerProcess, engine_pid, frozen

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
CHUNK = 32  # --max-num-batched-tokens: a 70-token prompt runs in three chunks


@pytest.fixture(scope="module")
def receiver() -> Iterator[HTTPReceiver]:
    rec = HTTPReceiver()
    yield rec
    rec.stop()


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           receiver: HTTPReceiver) -> Iterator[ServerProcess]:
    srv = ServerProcess(llama_dir, tmp_path_factory.mktemp("trace-logs"), "--scheduling-policy", "priority",
                        "--max-num-seqs", "1", "--max-num-batched-tokens", str(CHUNK), "--no-enable-prefix-caching",
                        "--otlp-traces-endpoint", receiver.endpoint, "--otlp-traces-protocol", "http/protobuf",
                        set_env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_a_traced_request_arrives_under_the_clients_trace(server, receiver):
    prompt = list(range(10, 80))
    unsampled = "1" * 32
    r0 = httpx.post(server.base_url + "/v1/completions", timeout=120,
                    headers={"traceparent": f"00-{unsampled}-{PARENT_ID}-00"},
                    json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert r0.status_code == 200
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                   json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0, "priority": 3})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    spans = receiver.wait_for(lambda s: sum(x.trace_id.hex() == TRACE_ID for x in s) >= 5)
    assert not any(s.trace_id.hex() == unsampled for s in receiver.spans)  # its parent was not sampled
    mine = {s.name: s for s in spans if s.trace_id.hex() == TRACE_ID}
    assert set(mine) == {"llm_request", "queue", "prefill", "decode", "response"}
    root = mine["llm_request"]
    assert root.parent_span_id.hex() == PARENT_ID
    assert all(mine[n].parent_span_id == root.span_id for n in ("queue", "prefill", "decode", "response"))
    attrs = attributes(root)
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] == len(prompt)
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.request.id"].startswith("cmpl-") and attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.temperature"] == 0 and attrs["pagoda.request.priority"] == 3
    assert attrs["gen_ai.latency.time_to_first_token"] > 0
    assert receiver.resources[0]["service.name"] == "pagoda"
    chunks = [attributes(e) for e in mine["prefill"].events if e.name == "prefill_chunk"]
    assert [c["pagoda.chunk.tokens"] for c in chunks] == [32, 32, 6]
    assert [c["pagoda.chunk.start"] for c in chunks] == [0, 32, 64]
    # The phases follow one another.
    assert (root.start_time_unix_nano <= mine["queue"].end_time_unix_nano <= mine["prefill"].end_time_unix_nano
            <= mine["decode"].end_time_unix_nano <= root.end_time_unix_nano)


def test_priority_and_timeout_bounds_are_400s(server):
    for body, param in (({"priority": 2**31}, "priority"), ({"timeout": 0}, "timeout"),
                        ({"timeout": 0.5}, "timeout"), ({"timeout": "soon"}, "timeout")):
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_deadlines_503_while_waiting_and_timeout_while_running(server):
    url = server.base_url + "/v1/completions"
    body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True, "timeout": 1.0}
    waited: list[httpx.Response] = []
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None  # running, the only slot taken
        second = threading.Thread(target=lambda: waited.append(
            httpx.post(url, json={"prompt": [4, 5], "max_tokens": 2, "timeout": 1.0}, timeout=120)))
        with frozen(engine_pid(server.base_url)):  # both deadlines pass while the engine is paused
            second.start()
            time.sleep(2.5)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        second.join(120)
    assert len(waited) == 1 and waited[0].status_code == 503, waited and waited[0].text
    assert waited[0].headers["Retry-After"] == "1"
    error = waited[0].json()["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "service_unavailable_error"
    assert "without starting" in error["message"]
    reasons = [c["finish_reason"] for chunk in rest for c in chunk["choices"] if c["finish_reason"]]
    assert reasons == ["timeout"]
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    timeouts = [line for line in text.splitlines() if line.startswith("pagoda:request_queue_timeouts_total{")]
    assert len(timeouts) == 1 and timeouts[0].endswith('priority="0"} 1.0'), timeouts


def test_per_priority_metrics(server):
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'pagoda:priority_requests_total{finished_reason="length",model_name=' in text
    assert 'priority="3"' in text and 'pagoda:priority_request_queue_time_seconds_count' in text
    assert 'pagoda:priority_time_to_first_token_seconds_bucket' in text
