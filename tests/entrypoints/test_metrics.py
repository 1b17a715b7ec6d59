"""``/metrics`` after a known workload against a live ``pagoda serve``: every counter equals what
the responses say was sent, and each histogram holds one sample per request. Also the periodic
stats log line, driven with a fake clock."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.messages import SchedulerStats
from pagoda.config import AUTO_MAX_STEPS
from pagoda.engine.output_processor import IterationStats
from pagoda.entrypoints.openai.stat_logger import StatLogger
from server_helpers import ServerProcess, start_server

MODEL = "tiny"
BLOCK_SIZE = 16
PREFIX = list(range(100, 140))  # 40 tokens: two full blocks, then a partial one
PER_REQUEST_HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                          "request_queue_time_seconds", "request_prefill_time_seconds",
                          "request_decode_time_seconds")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(llama_dir, tmp_path_factory.mktemp("metrics-logs"), "--served-model-name", MODEL)
    yield srv
    srv.stop()


def scrape(base_url: str) -> dict[str, float]:
    """Every sample as ``name{label=value,...}`` (labels sorted, model_name dropped) -> value."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def complete(base_url: str, prompt: list[int], max_tokens: int, stream: bool = False, **extra: Any) -> dict:
    """One completion; for a stream, the usage chunk and the finish reason of the last choice."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}
    if not stream:
        out = httpx.post(base_url + "/v1/completions", json=body, timeout=120).json()
        return {"usage": out["usage"], "finish_reason": out["choices"][0]["finish_reason"],
                "text": out["choices"][0]["text"]}
    body.update(stream=True, stream_options={"include_usage": True})
    result: dict[str, Any] = {"text": ""}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"] or result.get("finish_reason")
            result["usage"] = chunk.get("usage") or result.get("usage")
    return result


def run_workload(base_url: str) -> list[dict]:
    """Six requests, one at a time so that which blocks are cached is known: two reuse a
    40-token prefix (two of its blocks), one repeats an earlier prompt, one ends on a stop string."""
    other = list(range(200, 220))
    first = complete(base_url, PREFIX + [300, 301, 302, 303, 304], 6)
    results = [first,
               complete(base_url, PREFIX + list(range(310, 317)), 5),
               complete(base_url, other, 4, stream=True),
               complete(base_url, PREFIX + [320, 321, 322], 7, stream=True)]
    # The same prompt as the first, greedy: the same text, so a character of it is a stop string.
    stop = next((c for c in first["text"] if c.isascii() and c.isprintable() and not c.isspace()), None)
    assert stop is not None, f"need a visible character for a stop string: {first['text']!r}"
    results.append(complete(base_url, PREFIX + [300, 301, 302, 303, 304], 6, stop=[stop]))
    results.append(complete(base_url, other[:10], 3))
    return results


def test_every_metric_is_exposed(server: ServerProcess) -> None:
    """Names as vLLM's with the pagoda: prefix, present from start-up (zeros, not missing series)."""
    samples = scrape(server.base_url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "inter_token_latency_seconds_count",
                 "iteration_tokens_total_count", *(f"{h}_count" for h in PER_REQUEST_HISTOGRAMS)):
        assert f"pagoda:{name}" in samples, name
    for reason in ("stop", "length", "abort"):
        assert f"pagoda:request_success_total{{finished_reason={reason}}}" in samples
    assert not any("spec_decode" in name for name in samples)  # speculation is off


def test_counters_and_histograms_match_the_workload(server: ServerProcess) -> None:
    before = scrape(server.base_url)
    results = run_workload(server.base_url)
    after = scrape(server.base_url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    reasons = [r["finish_reason"] for r in results]
    assert reasons.count("stop") == 1 and reasons.count("length") == 5
    assert cached >= 2 * 2 * BLOCK_SIZE  # two requests reuse the prefix's two full blocks

    assert delta("pagoda:request_success_total{finished_reason=length}") == 5
    assert delta("pagoda:request_success_total{finished_reason=stop}") == 1
    assert delta("pagoda:prompt_tokens_total") == prompt
    assert delta("pagoda:generation_tokens_total") == generated
    assert delta("pagoda:prefix_cache_queries_total") == prompt
    assert delta("pagoda:prefix_cache_hits_total") == cached
    assert delta("pagoda:num_preemptions_total") == 0
    assert "pagoda:background_steps_abandoned_total" in after  # no batch ran: none given up
    assert delta("pagoda:background_steps_abandoned_total") == 0
    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(f"pagoda:{name}_count") == len(results), name
        assert delta(f"pagoda:{name}_sum") > 0, name
    # One interval per output after each request's first (vLLM's histogram): one per token when
    # each step gives one token, one per round of multi-step decoding (at most AUTO_MAX_STEPS).
    itls = delta("pagoda:inter_token_latency_seconds_count")
    rounds = sum(-(-(r["usage"]["completion_tokens"] - 1) // AUTO_MAX_STEPS) for r in results)
    assert rounds <= itls <= generated - len(results)

    # Each step computes the uncached prompt tokens, then one token per later output token; a
    # stop string is found after its step, so the engine may run on up to that request's max_tokens.
    computed = prompt - cached + generated - len(results)
    assert computed <= delta("pagoda:iteration_tokens_total_sum") <= computed + 6
    assert after["pagoda:num_requests_running"] == after["pagoda:num_requests_waiting"] == 0
    assert 0 <= after["pagoda:kv_cache_usage_perc"] <= 1


# ---- the periodic log line ---------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def iteration(prompt: int, generated: int) -> IterationStats:
    return IterationStats(timestamp=0.0, num_prompt_tokens=prompt, num_generation_tokens=generated)


def test_stat_logger_line_over_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stats = StatLogger(speculative=True, interval_s=5.0, clock=clock)
    stats.on_engine_stats(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=10, num_preemptions=1,
                                         spec_proposed=10, spec_accepted=5))
    clock.now += 5.0
    stats.log()  # the first interval: totals since start-up

    stats.on_iteration(iteration(300, 20))
    stats.on_iteration(iteration(100, 30))
    stats.on_engine_stats(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                                         prefix_cache_queries=500, prefix_cache_hits=210, num_preemptions=3,
                                         spec_proposed=50, spec_accepted=35))
    clock.now += 4.0
    with caplog.at_level(logging.INFO, logger="pagoda.stats"):
        line = stats.log()
    assert line == ("prompt throughput 100.0 tokens/s, generation throughput 12.5 tokens/s, running 3 reqs, "
                    "waiting 2 reqs, KV cache usage 25.0%, prefix cache hit rate 50.0%, preemptions 2, "
                    "spec acceptance rate 75.0%")
    assert caplog.messages == [line]


def test_stat_logger_quiet_when_idle_and_unchanged() -> None:
    clock = FakeClock()
    stats = StatLogger(clock=clock)
    clock.now += 5.0
    assert stats.log() is None  # nothing happened since start-up

    stats.on_iteration(iteration(0, 8))
    stats.on_engine_stats(SchedulerStats(num_running=1, kv_cache_usage=0.5))
    clock.now += 4.0
    busy = stats.log()
    assert busy is not None and "generation throughput 2.0 tokens/s" in busy
    assert "prefix cache hit rate -" in busy and "spec" not in busy

    stats.on_engine_stats(SchedulerStats(kv_cache_usage=0.0))  # the request finished
    clock.now += 5.0
    idle = stats.log()  # one line shows the drop to idle ...
    assert idle is not None and "running 0 reqs" in idle and "generation throughput 0.0" in idle
    clock.now += 5.0
    assert stats.log() is None  # ... then quiet


def test_speculative_decoding_counters(llama_dir: Path, tmp_path: Path) -> None:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    srv = start_server(llama_dir, tmp_path, "--served-model-name", MODEL, "--speculative-config", spec)
    try:
        # A repetitive prompt gives the n-gram proposer something to propose.
        results = [complete(srv.base_url, [7, 8, 9, 10] * 8, 24) for _ in range(2)]
        samples = scrape(srv.base_url)
        engine = httpx.get(srv.base_url + "/debug/engine", timeout=30).json()
    finally:
        srv.stop()
    drafts = samples["pagoda:spec_decode_num_draft_tokens_total"]
    accepted = samples["pagoda:spec_decode_num_accepted_tokens_total"]
    assert drafts == engine["spec_proposed"] > 0
    assert accepted == engine["spec_accepted"] <= drafts
    # One interval per step that brought a request tokens, however many it brought.
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    assert samples["pagoda:generation_tokens_total"] == generated
    # Each accepted draft token rides in a step with others: at most one interval fewer.
    itls = samples["pagoda:inter_token_latency_seconds_count"]
    assert generated - len(results) - accepted <= itls <= generated - len(results)
