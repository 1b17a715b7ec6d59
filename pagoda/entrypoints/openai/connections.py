"""What a connection may hold before it is a request: uvicorn's HTTP protocol (httptools) with
the bounds it lacks against hostile clients.

- A deadline for the request line and headers (``--request-header-timeout``): a connection that
  has not sent complete headers that long after it opened, or after the first byte of its next
  request, gets a 408 and is closed (slowloris). Idle keep-alive connections are uvicorn's
  ``timeout_keep_alive``.
- A bound on the bytes of the request line and headers (``--max-request-header-size``): httptools
  itself accepts headers of any length. Beyond it: 431 and closed.
- Lazy bodies: reading stops when a request's headers are complete, until the app first asks
  for the body, so a request refused from its headers costs no body reads.
- Caps on open connections, in all (``--max-connections``) and per client address
  (``--max-connections-per-client``): a connection beyond either gets an OpenAI-shaped 503 to its
  request and is closed, without its body being read.

Everything here runs in the protocol's callbacks on the event loop, before any ASGI task exists.
"""
from __future__ import annotations

import asyncio
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagoda.entrypoints.openai.serving_common import APIError

DEFAULT_REQUEST_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_REQUEST_HEADER_SIZE = 64 << 10
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of one server; a cap of 0 means none."""
    header_timeout_s: float = DEFAULT_REQUEST_HEADER_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_REQUEST_HEADER_SIZE
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT


def protocol_factory(limits: ConnectionLimits, on_refused: Callable[[int], None]) -> Callable[..., Any]:
    """What to pass as ``uvicorn.Config(http=...)``: every connection of the server shares one
    count of open connections per client address."""
    return functools.partial(GuardedHttpProtocol, limits=limits, per_client=Counter(), on_refused=on_refused)


class GuardedHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with a header deadline, a header size bound and connection caps."""

    def __init__(self, *args: Any, limits: ConnectionLimits, per_client: Counter[str],
                 on_refused: Callable[[int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.per_client = per_client
        self.on_refused = on_refused
        self.client_host: str | None = None
        self.header_timer: asyncio.TimerHandle | None = None
        self.header_bytes = 0  # of the request whose headers are being received; -1: none is

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.client_host = self.client[0] if self.client else None
        if self.client_host is not None:
            self.per_client[self.client_host] += 1
        over = self._over_cap()
        if over is not None:
            self.app = _refusal_app(over, self.on_refused)  # this connection's requests: 503, no body read
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self.client_host is not None:
            self.per_client[self.client_host] -= 1
            if self.per_client[self.client_host] <= 0:
                del self.per_client[self.client_host]
            self.client_host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.header_bytes < 0 or self.transport.is_closing():
            return
        # Counted after parsing: a chunk that completed the headers (and may carry body) is not.
        self.header_bytes += len(data)
        if self.header_bytes > self.limits.max_header_bytes > 0:
            self._close_with(431, b"Request Header Fields Too Large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_bytes < 0:  # the next request on a kept-alive connection
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        self.header_bytes = -1
        super().on_headers_complete()
        if not self.parser.should_upgrade():
            # No body is read until the app asks for it (uvicorn's receive() resumes reading): a
            # request refused from its headers (a wrong key, a full server) costs no body reads.
            self.flow.pause_reading()

    # ---- helpers ---------------------------------------------------------------------------

    def _over_cap(self) -> str | None:
        total, per_client = self.limits.max_connections, self.limits.max_connections_per_client
        if total and len(self.connections) > total:
            return f"the server has its maximum of {total} open connections (--max-connections)"
        if per_client and self.client_host is not None and self.per_client[self.client_host] > per_client:
            return (f"this client address has its maximum of {per_client} open connections "
                    "(--max-connections-per-client)")
        return None

    def _await_headers(self) -> None:
        self.header_bytes = 0
        if self.limits.header_timeout_s > 0 and self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        self._close_with(408, b"Request Timeout")

    def _close_with(self, status: int, reason: bytes) -> None:
        """Answer a request that never got to the app (when no answer is under way) and close."""
        self._stop_header_timer()
        self.header_bytes = -1
        if self.transport.is_closing():
            return
        self.on_refused(status)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % (status, reason))
        self.transport.close()


def _refusal_app(message: str, on_refused: Callable[[int], None]) -> Callable[[Scope, Receive, Send], Any]:
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        on_refused(503)
        response = APIError(503, message, code="too_many_connections").response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

    return refuse
