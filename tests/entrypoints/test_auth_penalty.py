"""The wrong-key penalty: past a burst of 401s a client address gets each further one only after
``--auth-failure-delay``, marked with ``Retry-After``, its body unread; other addresses and
clients with the key are not slowed. Driven through ``RequestGuard`` as an ASGI app, with a
fake clock for the bucket (no timing asserted)."""
from __future__ import annotations

import asyncio
from typing import Any

from pagoda.entrypoints.openai.admission import AUTH_FAILURE_ADDRESSES, AuthFailurePenalty, RequestGuard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_a_burst_then_delays_and_refills() -> None:
    clock = Clock()
    penalty = AuthFailurePenalty(2.0, burst=3, rate=1.0, clock=clock)
    assert [penalty.wait_s("a") for _ in range(5)] == [0.0, 0.0, 0.0, 2.0, 2.0]
    assert penalty.wait_s("b") == 0.0  # another address has its own bucket
    clock.now += 1.0  # one answer refilled
    assert penalty.wait_s("a") == 0.0 and penalty.wait_s("a") == 2.0
    clock.now += 100.0  # refilled up to the burst, no further
    assert [penalty.wait_s("a") for _ in range(4)] == [0.0, 0.0, 0.0, 2.0]
    assert AuthFailurePenalty(0.0, burst=0).wait_s("a") == 0.0  # delay 0: off
    assert penalty.wait_s(None) == 0.0  # no address known: nothing to count against


def test_remembered_addresses_are_bounded() -> None:
    clock = Clock()
    penalty = AuthFailurePenalty(1.0, burst=2, rate=1.0, clock=clock)
    for i in range(3 * AUTH_FAILURE_ADDRESSES):
        penalty.wait_s(f"10.0.{i // 256}.{i % 256}")
    assert len(penalty._buckets) <= AUTH_FAILURE_ADDRESSES


def _call(guard: RequestGuard, key: str, host: str) -> tuple[int, dict[bytes, bytes], bool]:
    """(status, headers, whether the body was read) of one POST through ``guard``."""
    read: list[bool] = []

    async def receive() -> dict[str, Any]:
        read.append(True)
        return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "client": (host, 5000),
             "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]}
    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), bool(read)


async def _ok_app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_guard_delays_a_repeated_wrong_key_and_says_so() -> None:
    refused: list[int] = []
    guard = RequestGuard(_ok_app, "k", 1 << 20, 5.0, refused.append, auth_failure_delay=0.01)
    guard.penalty = AuthFailurePenalty(0.01, burst=1, rate=1e-6)
    status, headers, read = _call(guard, "wrong", "10.1.1.1")
    assert (status, read) == (401, False) and b"retry-after" not in headers
    status, headers, read = _call(guard, "wrong", "10.1.1.1")  # past the burst: delayed and marked
    assert (status, read) == (401, False) and headers[b"retry-after"] == b"1"
    assert headers[b"connection"] == b"close"
    assert b"retry-after" not in _call(guard, "wrong", "10.1.1.2")[1]  # another address: at once
    status, headers, read = _call(guard, "k", "10.1.1.1")  # the key from the penalised address
    assert (status, read) == (200, True) and b"retry-after" not in headers
    assert refused == [401, 401, 401]
