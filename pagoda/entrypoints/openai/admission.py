"""What the server refuses before any work is done: request bodies over a size limit (413)
and requests beyond the admission bound (429 with ``Retry-After``).

The body limit is a pure ASGI middleware: it reads the body itself, up to the limit, before the
app parses anything, so an oversized request costs at most ``limit`` bytes of memory and no
JSON parsing. Requests that declare a ``Content-Length`` over the limit are refused without
reading a byte of their body.
"""
from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.engine.core_client import EngineOverloadedError
from pagoda.entrypoints.openai.serving_common import APIError

DEFAULT_MAX_REQUEST_BODY_SIZE = 32 << 20
# Seconds a client refused for a full queue is told to wait before retrying.
RETRY_AFTER_S = 1


class BodyLimitMiddleware:
    """Answer 413 to any HTTP request whose body exceeds ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[int], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refused(413)
        error = APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes "
                              "(--max-request-body-size)", code="request_too_large")
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the already-read body, then waits on the real one
    (which is how a streaming response learns that its client went away)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install(app: FastAPI, max_request_body_size: int, on_refused: Callable[[int], None]) -> None:
    """Add the body limit and the 429 answer for a full queue to ``app``."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_size, on_refused=on_refused)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        on_refused(429)
        response = APIError(429, str(exc), code="server_overloaded", type="rate_limit_error").response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
