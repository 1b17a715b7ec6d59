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

from server_helpers import ServerProcess, side_by_side

MODEL = "tiny"
GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("metrics-compat-logs")
    # Started together so the two start-ups overlap on a small machine.
    started = {"compat": ServerProcess(llama_dir, logs, "--served-model-name", MODEL, "--metrics-compat", "vllm"),
               "plain": ServerProcess(llama_dir, logs, "--served-model-name", MODEL)}
    with side_by_side(started) as ready:
        yield ready


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

    # Mid-workload: a stream is running, so the gauges hold something other than zeros.
    body = {"model": MODEL, "prompt": list(range(200, 240)), "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    others = [threading.Thread(target=complete, args=(url, 8)) for _ in range(3)]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # the first token has come
        for thread in others:
            thread.start()
        mid = gauges(url)
        for _ in lines:  # read it to the end
            pass
    for thread in others:
        thread.join(120)
    assert mid["pagoda:num_requests_running"] >= 1
    assert mid["pagoda:kv_cache_usage_perc"] > 0
    assert_mirrored(mid)

    assert_mirrored(gauges(url))


def test_vllm_names_absent_by_default(servers: dict[str, ServerProcess]) -> None:
    url = servers["plain"].base_url
    complete(url, 4)
    text = httpx.get(url + "/metrics", timeout=30).text
    assert "pagoda:num_requests_waiting" in text
    assert "vllm:" not in text
