"""``pagoda serve --metrics-compat vllm``: the queue and KV-cache gauges also go out under vLLM's
names, equal to the ``pagoda:`` ones, mid-request and after a workload; without the flag no
``vllm:`` series exists."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, start_server

MODEL = "tiny"
GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path,
            tiny_server: ServerProcess) -> Iterator[dict[str, ServerProcess]]:
    """The compat server of this module, and the session's plain one (default options)."""
    srv = start_server(llama_dir, tmp_path_factory.mktemp("metrics-compat-logs"), "--served-model-name", MODEL,
                       "--metrics-compat", "vllm")
    yield {"compat": srv, "plain": tiny_server}
    srv.stop()


def gauges(base_url: str) -> dict[str, float]:
    """``prefix:name`` -> value of every sample for our model, from one scrape."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("model_name") == MODEL}


def complete(base_url: str, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": list(range(100, 130)), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    httpx.post(base_url + "/v1/completions", json=body, timeout=120).raise_for_status()


def assert_mirrored(samples: dict[str, float]) -> None:
    for name in GAUGES:
        assert f"vllm:{name}" in samples, name
        assert samples[f"vllm:{name}"] == samples[f"pagoda:{name}"], name


def test_vllm_names_mirror_pagoda_gauges(servers: dict[str, ServerProcess]) -> None:
    url = servers["compat"].base_url
    assert_mirrored(gauges(url))  # present from the start, as zeros

    # Mid-workload: scraped again and again while eight 200-token requests run (a quiet machine
    # finishes one such request in a fraction of a second, so one scrape could come too late);
    # the busiest scrape holds something other than zeros, and every scrape mirrors.
    workers = [threading.Thread(target=complete, args=(url, 200)) for _ in range(8)]
    for worker in workers:
        worker.start()
    samples = []
    while any(worker.is_alive() for worker in workers):
        samples.append(gauges(url))
    for worker in workers:
        worker.join(120)
    assert samples
    for sample in samples:
        assert_mirrored(sample)
    mid = max(samples, key=lambda g: g["pagoda:num_requests_running"])
    assert mid["pagoda:num_requests_running"] >= 1
    assert mid["pagoda:kv_cache_usage_perc"] > 0

    assert_mirrored(gauges(url))


def test_vllm_names_absent_by_default(servers: dict[str, ServerProcess]) -> None:
    url = servers["plain"].base_url
    complete(url, 4)
    text = httpx.get(url + "/metrics", timeout=30).text
    assert "pagoda:num_requests_waiting" in text
    assert "vllm:" not in text
