"""What the server refuses before any work is done: requests without the API key (401, from
the headers alone), request bodies over a size limit (413) or slower than a deadline (408), and
requests beyond the admission bound (429 with ``Retry-After``).

``RequestGuard`` is a pure ASGI middleware in front of the app. It checks the key before it
reads a byte of the body, then reads the body itself, up to the limit and within the deadline,
before the app parses anything: a client without the key costs no body memory and no parsing,
an oversized request at most ``limit`` bytes of memory. Requests that declare a
``Content-Length`` over the limit are refused without reading their body. Every refusal here
closes the connection (``Connection: close``), so an unread body is never read.

A client address that keeps failing the key check is slowed down (``AuthFailurePenalty``): past
a burst of immediate 401s, each further one waits ``--auth-failure-delay`` seconds before it is
sent, its connection held unread meanwhile. A client that sends wrong-key bodies in a loop then
blocks on its own full socket buffers instead of costing the server (and the cores it shares)
a refused connection every fraction of a millisecond; guessing keys gets as slow.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.engine.core_client import EngineOverloadedError
from pagoda.entrypoints.openai.body_check import BodyChecker
from pagoda.entrypoints.openai.serving_common import APIError

DEFAULT_MAX_REQUEST_BODY_SIZE = 32 << 20
# Seconds a client has to send a whole request body once its headers are in.
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# Seconds a client refused for a full queue is told to wait before retrying.
RETRY_AFTER_S = 1
# The paths any client may call without the API key (probes and scrapers, the API document, and
# the dashboard's page and assets, which hold no data: its snapshot needs the key); every other
# path, known or not, needs the key when the server has one.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/dashboard"})
PUBLIC_PREFIXES = ("/dashboard/static/",)
# Wrong-key answers a client address gets at once (the bucket) and how fast they come back, a second.
AUTH_FAILURE_BURST = 20
AUTH_FAILURE_RATE = 10.0
DEFAULT_AUTH_FAILURE_DELAY_S = 1.0
# Addresses the penalty remembers; past it, those whose bucket has refilled are forgotten.
AUTH_FAILURE_ADDRESSES = 4096
INVALID_KEY_MESSAGE = "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')"


def key_matches(authorization: str, api_key: str, x_api_key: str | None = None) -> bool:
    """Whether the request carries ``api_key``: as ``Authorization: Bearer <key>``, or, without a
    bearer token, as ``x-api-key`` (Anthropic's clients); compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        if x_api_key is None:
            return False
        token = x_api_key
    return secrets.compare_digest(token.strip().encode(), api_key.encode())


class _BodyTooLarge(Exception):
    pass


class AuthFailurePenalty:
    """How long the next 401 to a client address waits: each address may get ``burst`` of them
    at once, refilled at ``rate`` a second; beyond that, each waits ``delay`` seconds (0: never)."""

    def __init__(self, delay: float, burst: int = AUTH_FAILURE_BURST, rate: float = AUTH_FAILURE_RATE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.delay, self.burst, self.rate, self.clock = delay, burst, rate, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (immediate answers left, when)

    def wait_s(self, address: str | None) -> float:
        """Count one failure of ``address`` and return how long its 401 waits."""
        if self.delay <= 0 or address is None:
            return 0.0
        now = self.clock()
        left = self._left(address, now)
        if len(self._buckets) >= AUTH_FAILURE_ADDRESSES and address not in self._buckets:
            self._forget_refilled(now)
        if left >= 1.0:
            self._buckets[address] = (left - 1.0, now)
            return 0.0
        self._buckets[address] = (left, now)
        return self.delay

    def _left(self, address: str, now: float) -> float:
        left, when = self._buckets.get(address, (float(self.burst), now))
        return min(float(self.burst), left + (now - when) * self.rate)

    def _forget_refilled(self, now: float) -> None:
        full = [a for a in self._buckets if self._left(a, now) >= self.burst]
        for address in full or list(self._buckets)[:len(self._buckets) // 2]:  # all busy: the oldest half
            del self._buckets[address]


class RequestGuard:
    """Answer 401 to a request without the key (before its body is read), 413 to a body over
    ``max_bytes``, 408 to a body not received within ``body_timeout_s``, 400 to a large body
    ``checker`` finds invalid; hand the app the whole body otherwise. ``api_key`` None: no key
    needed. ``auth_failure_delay``: ``AuthFailurePenalty``'s delay."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int, body_timeout_s: float,
                 on_refused: Callable[[int], None], checker: BodyChecker | None = None,
                 path_limits: dict[str, int] | None = None,
                 auth_failure_delay: float = DEFAULT_AUTH_FAILURE_DELAY_S) -> None:
        self.app = app
        self.path_limits = path_limits or {}  # routes with their own body limit (file uploads)
        self.checker = checker
        self.api_key = api_key
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        self.on_refused = on_refused
        self.penalty = AuthFailurePenalty(auth_failure_delay)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await self._refuse_key(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, self._too_large(limit))
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive, limit)
        except TimeoutError:
            error = APIError(408, f"the request body was not received within {self.body_timeout_s:g} s "
                                  "(--request-body-timeout)", code="request_timeout")
            await self._refuse(scope, receive, send, error)
            return
        except _BodyTooLarge:
            await self._refuse(scope, receive, send, self._too_large(limit))
            return
        if body is None:  # the client left before sending its body: nothing to answer
            return
        if self.checker is not None and self.checker.wants(scope["method"], scope["path"],
                                                           _header(scope, b"content-type"), len(body)):
            error = await self.checker.check(scope["path"], body)
            if error is not None:
                await self._refuse(scope, receive, send, error)
                return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        path = scope["path"]
        if self.api_key is None or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return True
        return key_matches(_header(scope, b"authorization"), self.api_key, _header(scope, b"x-api-key") or None)

    async def _refuse_key(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The 401, after the address's penalty wait (the body stays unread: the client's
        socket buffers fill and it stops sending)."""
        client = scope.get("client")
        wait = self.penalty.wait_s(client[0] if client else None)
        if wait:
            await asyncio.sleep(wait)
        error = APIError(401, INVALID_KEY_MESSAGE, code="invalid_api_key")
        await self._refuse(scope, receive, send, error, retry_after=wait)

    async def _read_body(self, receive: Receive, limit: int) -> bytes | None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                raise _BodyTooLarge
            if not message.get("more_body", False):
                return bytes(body)

    def _too_large(self, limit: int) -> APIError:
        flag = "--max-request-body-size" if limit == self.max_bytes else "--max-batch-file-bytes"
        return APIError(413, f"the request body is larger than the server's limit of {limit} bytes ({flag})",
                        code="request_too_large")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: APIError,
                      retry_after: float = 0.0) -> None:
        self.on_refused(error.status)
        response = error.response()
        response.headers["Connection"] = "close"  # the server closes it after the answer: no unread body is read
        if retry_after:  # a penalised 401 says so
            response.headers["Retry-After"] = str(max(1, round(retry_after)))
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


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


def install(app: FastAPI, max_request_body_size: int, on_refused: Callable[[int], None], api_key: str | None = None,
            request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S, checker: BodyChecker | None = None,
            path_limits: dict[str, int] | None = None,
            auth_failure_delay: float = DEFAULT_AUTH_FAILURE_DELAY_S) -> None:
    """Add the ``RequestGuard`` (key, wrong-key penalty, body limit, body deadline, large-body
    check) and the 429 answer for a full queue to ``app``. ``on_refused`` is told the status of
    every refusal; ``path_limits`` gives paths a body limit of their own."""
    app.add_middleware(RequestGuard, api_key=api_key, max_bytes=max_request_body_size,
                       body_timeout_s=request_body_timeout, on_refused=on_refused, checker=checker,
                       path_limits=path_limits, auth_failure_delay=auth_failure_delay)
    add_overload_handler(app, on_refused)


def add_overload_handler(app: FastAPI, on_refused: Callable[[int], None]) -> None:
    """Answer ``EngineOverloadedError`` (a full queue) with 429 and ``Retry-After``."""

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        on_refused(429)
        response = APIError(429, str(exc), code="server_overloaded", type="rate_limit_error").response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


def json_list(text: str) -> list[str]:
    """A CORS flag's value: a JSON list of strings, as vLLM's (``'["*"]'``)."""
    import argparse

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings such as '[\"*\"]': {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings such as '[\"*\"]', got {text}")
    return value


def add_cors_args(parser: Any) -> None:
    """vLLM's CORS flags, with its defaults (any origin, method and header; no credentials)."""
    parser.add_argument("--allowed-origins", type=json_list, default=["*"],
                        help="CORS: origins browsers may call the API from (JSON list)")
    parser.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS: allowed methods (JSON list)")
    parser.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS: allowed headers (JSON list)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def install_cors(app: FastAPI, args: Any) -> None:
    """Browsers' cross-origin requests, as vLLM answers them: the outermost layer, so a preflight
    (OPTIONS, which carries no key) is answered before the key check, and every answer (a 401
    or 429 included) carries the CORS headers a browser needs to read it."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=getattr(args, "allowed_origins", ["*"]),
                       allow_credentials=getattr(args, "allow_credentials", False),
                       allow_methods=getattr(args, "allowed_methods", ["*"]),
                       allow_headers=getattr(args, "allowed_headers", ["*"]))
