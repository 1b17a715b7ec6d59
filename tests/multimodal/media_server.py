"""A loopback HTTP server for the image-fetching tests: fixed routes (an image, a redirect, a
slow answer held until the test releases it, ...) and a log of the requests it received."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

# How long a held request waits for the test's release before it answers anyway.
HOLD_LIMIT_S = 30.0


class MediaServer:
    """``routes``: path -> (status, headers, body); a body that is a callable is called with
    the handler to write the answer itself (slow or streamed answers)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes | Callable]] = {}
        self.requests: list[tuple[str, str]] = []  # (Host header, path)
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.requests.append((self.headers.get("Host", ""), self.path))
                status, headers, body = server.routes.get(self.path, (404, {}, b"not found"))
                if callable(body):
                    body(self)
                    return
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def hits(self, path: str) -> int:
        return sum(1 for _, p in self.requests if p == path)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
