"""A restarted ``pagoda serve`` on the same disk tier serves a known prefix from disk: the first
request after the restart reports its prompt as cached, with the same output, and /metrics
counts the disk hits."""
from __future__ import annotations

import random

import httpx

from tests.entrypoints.server_helpers import start_server


def complete(base_url: str, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_restarted_server_serves_a_known_prefix_from_disk(llama_dir, tmp_path):
    rng = random.Random(0)
    prompt = [rng.randrange(10, 500) for _ in range(320)]
    disk = tmp_path / "kv"
    args = ("--served-model-name", "m", "--kv-offload-disk-path", str(disk))
    first = start_server(llama_dir, tmp_path, *args)
    try:
        before = complete(first.base_url, prompt)
    finally:
        assert first.stop() == 0
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = start_server(llama_dir, tmp_path, *args)
    try:
        after = complete(second.base_url, prompt)
        metrics = httpx.get(second.base_url + "/metrics", timeout=30).text
    finally:
        second.stop()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(prompt)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    hits = [line for line in metrics.splitlines()
            if line.startswith("pagoda:kv_offload_blocks_total") and 'tier="disk"' in line and 'event="hit"' in line]
    assert hits and float(hits[0].split()[-1]) >= 18
