"""What a live ``pagoda serve`` does under pressure: /health stays 200 through a long engine
step and turns 503 only when the engine loop is stuck; a full queue answers 429 with
Retry-After and loses nothing it accepted; oversized bodies get 413 before they are parsed;
the tokenizer survives concurrent big and small texts."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from server_helpers import ServerProcess, engine_pid, frozen, side_by_side

MODEL = "tiny"
MAX_NUM_SEQS = 2
MAX_QUEUED = 2
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two servers started side by side: a small queue; a short stall timeout and body limit."""
    log_dir = tmp_path_factory.mktemp("admission-logs")
    started = {
        "queue": ServerProcess(llama_dir, log_dir, "--served-model-name", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS),
                               "--max-queued-requests", str(MAX_QUEUED)),
        "strict": ServerProcess(llama_dir, log_dir, "--served-model-name", MODEL, "--engine-stall-timeout", "1.5",
                                "--max-request-body-size", str(BODY_LIMIT)),
    }
    with side_by_side(started):
        yield started


def timed_health(base_url: str) -> tuple[int, float]:
    start = time.monotonic()
    status = httpx.get(base_url + "/health", timeout=5).status_code
    return status, time.monotonic() - start


def completion(base_url: str, max_tokens: int, stream: bool = False, timeout: float = 120) -> httpx.Response:
    body = {"model": MODEL, "prompt": "queue me", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return httpx.post(base_url + "/v1/completions", json=body, timeout=timeout)


def streamed_usage(resp: httpx.Response) -> int:
    events = [json.loads(line[5:]) for line in resp.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    assert events and "usage" in events[-1] and events[-1]["usage"], events[-1:]
    return events[-1]["usage"]["completion_tokens"]


def test_health_answers_fast_during_a_long_step(servers: dict[str, ServerProcess]) -> None:
    base = servers["queue"].base_url
    with frozen(engine_pid(base)):  # a step that takes 3 s, as far as the server can tell
        answers = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            answers.append(timed_health(base))
            time.sleep(0.2)
    assert all(status == 200 for status, _ in answers), answers
    assert max(elapsed for _, elapsed in answers) < 1.0, answers


def test_health_reports_a_wedged_engine_and_recovers(servers: dict[str, ServerProcess]) -> None:
    base = servers["strict"].base_url
    assert timed_health(base)[0] == 200
    with frozen(engine_pid(base)):  # stopped for longer than --engine-stall-timeout 1.5
        time.sleep(2.5)
        resp = httpx.get(base + "/health", timeout=5)
        assert resp.status_code == 503
        assert "no progress" in resp.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while timed_health(base)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert timed_health(base)[0] == 200


def test_full_queue_answers_429_and_loses_nothing_it_accepted(servers: dict[str, ServerProcess]) -> None:
    base = servers["queue"].base_url
    capacity = MAX_NUM_SEQS + MAX_QUEUED
    with concurrent.futures.ThreadPoolExecutor(capacity) as pool:
        with frozen(engine_pid(base)):  # nothing can finish: every accepted request stays in flight
            accepted = [pool.submit(completion, base, 5, stream=i % 2 == 0) for i in range(capacity)]
            time.sleep(1.0)  # all of them are in the server, waiting on the paused engine
            refused = completion(base, 5)
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        results = [f.result(timeout=120) for f in accepted]
    for i, resp in enumerate(results):
        assert resp.status_code == 200, resp.text
        tokens = streamed_usage(resp) if i % 2 == 0 else resp.json()["usage"]["completion_tokens"]
        assert tokens == 5
    assert completion(base, 3).status_code == 200  # room again once they finished


def test_oversized_bodies_are_refused_before_parsing(servers: dict[str, ServerProcess]) -> None:
    base = servers["strict"].base_url
    big = {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 1), "max_tokens": 1}
    resp = httpx.post(base + "/v1/completions", json=big, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold on the bytes read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'

    resp = httpx.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 413
    assert completion(base, 2).status_code == 200


def test_tokenizer_shared_by_big_and_small_texts_concurrently(servers: dict[str, ServerProcess],
                                                             llama_dir: Path) -> None:
    base = servers["queue"].base_url
    reference = AutoTokenizer.from_pretrained(str(llama_dir))
    texts = [("big text number %d " % i) * 400 if i % 2 else f"small {i}" for i in range(24)]
    errors: list[str] = []

    def tokenize(text: str) -> None:
        resp = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
        if resp.status_code != 200 or resp.json()["tokens"] != reference.encode(text):
            errors.append(f"{resp.status_code}: {resp.text[:200]}")

    threads = [threading.Thread(target=tokenize, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
