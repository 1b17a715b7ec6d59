"""Running one batch line: through the server's own app, as an online request would run, at
the batch class's priority and within the batch concurrency cap.

A line is sent to the same ASGI app that serves HTTP (same routes, validation, field policy,
errors), in process: nothing is implemented twice, and a line's response body is what the
online endpoint would have answered. Batch lines yield to interactive requests: every line runs
in the scheduler's background class (``BACKGROUND_SCOPE_KEY``, whatever the scheduling policy),
so it is scheduled only in steps with no interactive request in the engine and is paused (then
preempted first) when one comes (``scheduler/background.py``); under ``--scheduling-policy
priority`` it is also sent at the batch priority (``batch_priority``); and ``BatchGate`` starts a
line only while the engine has a free sequence slot and nothing waiting, and never more than
``--max-concurrent-batch-requests`` at once.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.serving_common import BACKGROUND_SCOPE_KEY
from pagoda.scheduler.priority import BATCH_PRIORITY

DEFAULT_MAX_CONCURRENT_BATCH_REQUESTS = 4
# How often a line waiting for room looks again (room frees without a notification).
GATE_POLL_S = 0.02
# A line refused for a full queue (429) or an unavailable engine (503) is tried again this
# many times, this many seconds apart, before its refusal is its result.
RETRIES = 30
RETRY_DELAY_S = 1.0


@dataclass
class LineResponse:
    """What the app answered a line: its HTTP status and JSON body."""

    status: int
    body: Any


class BatchGate:
    """At most ``cap`` batch lines at once, each started only while the engine has a free
    sequence slot and no request waits for one (interactive requests never queue behind
    batch lines)."""

    def __init__(self, engine: AsyncEngine, cap: int) -> None:
        self.engine = engine
        self.cap = max(1, cap)
        self.active = 0

    def _room(self) -> bool:
        if self.active >= self.cap:
            return False
        in_flight = len(self.engine.output_processor.requests)  # engine requests not finished
        stats = self.engine.last_stats
        # The stats are the last step's: with nothing in flight nothing can wait, whatever
        # they said (an aborted waiter leaves no newer step behind it).
        waiting = stats.num_waiting if stats is not None and in_flight else 0
        return in_flight < self.engine.config.scheduler.max_num_seqs and waiting == 0

    async def acquire(self) -> None:
        while not self._room():
            await asyncio.sleep(GATE_POLL_S)
        self.active += 1

    def release(self) -> None:
        self.active -= 1


def batch_priority(policy: str) -> int | None:
    """The ``priority`` batch lines are sent with: the scheduler's batch class under the
    ``priority`` policy; none under another (which refuses a priority other than 0)."""
    return BATCH_PRIORITY if policy == "priority" else None


def line_body(body: dict[str, Any], priority: int | None) -> bytes:
    """The request body a line is sent with: its own, at ``priority`` when one is given (a
    line cannot choose its own)."""
    if priority is not None:
        body = {**body, "priority": priority}
    return json.dumps(body).encode()


async def call_app(app: ASGIApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                   scope_extra: dict[str, Any], cancelled: asyncio.Event) -> LineResponse:
    """POST ``body`` to ``path`` of ``app`` in process, in the background class; ``cancelled``
    set looks to the app like its client going away (the engine request is aborted, a 499)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers], **scope_extra, BACKGROUND_SCOPE_KEY: True}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await cancelled.wait()
        return {"type": "http.disconnect"}

    status = 500
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    raw = b"".join(chunks)
    try:
        return LineResponse(status, json.loads(raw) if raw else None)
    except ValueError:
        return LineResponse(status, {"error": {"message": raw.decode(errors="replace")[:1000],
                                               "type": "server_error", "param": None, "code": None}})


def result_line(custom_id: str, response: LineResponse | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """One line of a batch's output or error file, in OpenAI's shape."""
    body = response.body if response is not None else None
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": None if response is None else {
                "status_code": response.status, "request_id": request_id or f"req_{uuid.uuid4().hex}",
                "body": body},
            "error": error}


def line_error(status: int, message: str, param: str | None = None, code: str | None = None) -> LineResponse:
    """A response the runner gives a line itself (it was not sent), in OpenAI's error shape."""
    return LineResponse(status, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                           "code": code}})
