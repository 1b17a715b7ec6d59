"""What a client without the key, or with a slow or crowded connection, can get from a live
``pagoda serve``: a 401 before its body is read, a 408 for a slow body or slow headers, a 431 for
huge headers, a 503 beyond the connection caps; each connection closed by the server. Raw
sockets, since an HTTP client would send the whole body first."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from server_helpers import ServerProcess, serve_command, start_server

API_KEY = "door-key"
PER_CLIENT = 3
TOTAL = 5
ANSWER_WAIT_S = 30.0  # the socket timeout: far above the 1 s deadlines of the server under test


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(llama_dir, tmp_path_factory.mktemp("guard-logs"), "--served-model-name", "tiny",
                       "--api-key", API_KEY, "--request-header-timeout", "1", "--request-body-timeout", "1",
                       "--max-request-header-size", "8KiB", "--max-connections", str(TOTAL),
                       "--max-connections-per-client", str(PER_CLIENT))
    yield srv
    srv.stop()


def connect(srv: ServerProcess, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=ANSWER_WAIT_S, source_address=(source, 0))
    return sock


def head(path: str, length: int, key: str | None, method: str = "POST") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_wrong_key_gets_401_before_the_body_is_sent(server: ServerProcess) -> None:
    """Headers and 1 KiB of a declared 30 MB body: the 401 comes back and the connection is
    closed although 30 MB are still to come."""
    for key in ("wrong", None):
        with connect(server) as sock:
            sock.sendall(head("/v1/completions", 30_000_000, key) + b'{"prompt": [' + b"1, " * 340)
            status, headers, body = parse(read_until_closed(sock))
        assert status == 401 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    # Unknown paths need the key too; the probes do not.
    assert httpx.get(server.base_url + "/v1/nothing").status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200
    good = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "tiny", "prompt": "with the key", "max_tokens": 2}, timeout=120)
    assert good.status_code == 200, good.text


def test_slow_body_gets_408_and_is_closed(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(head("/v1/completions", 100, API_KEY) + b'{"prompt": ')  # and nothing more
        status, headers, body = parse(read_until_closed(sock))
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_incomplete_or_huge_headers_are_closed(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * (16 << 10))
        assert read_until_closed(sock).startswith(b"HTTP/1.1 431 ")
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_connection_caps_answer_503(server: ServerProcess) -> None:
    """PER_CLIENT connections from one address, then one more gets 503; another address may
    still connect until the server holds TOTAL, beyond which everyone gets 503."""
    held = [connect(server) for _ in range(PER_CLIENT)]
    try:
        for sock in held:  # each one answered, so each is surely counted
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        assert over_cap(server, "127.0.0.1") == "--max-connections-per-client"
        held += [connect(server, "127.0.0.2") for _ in range(TOTAL - PER_CLIENT)]
        for sock in held[PER_CLIENT:]:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        assert over_cap(server, "127.0.0.2") == "--max-connections"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.base_url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)  # the server sees the closes a moment later
    assert httpx.get(server.base_url + "/health").status_code == 200


def over_cap(server: ServerProcess, source: str) -> str:
    """The flag a refused connection's 503 names (its body is never read)."""
    with connect(server, source) as sock:
        sock.sendall(head("/v1/completions", 10_000_000, API_KEY) + b"{")
        status, headers, body = parse(read_until_closed(sock))
    assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
    error = json.loads(body)["error"]
    assert error["code"] == "too_many_connections"
    return error["message"].rsplit("(", 1)[1].rstrip(")")


def test_405_names_the_allowed_methods(server: ServerProcess) -> None:
    resp = httpx.get(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("how", ["flag", "env"])
def test_empty_api_key_is_refused_at_start(how: str) -> None:
    args, env = (["--api-key", ""], {}) if how == "flag" else ([], {"PAGODA_API_KEY": ""})
    proc = subprocess.run(serve_command("--port", "1", *args), capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 1 and "the API key is empty" in proc.stderr, proc.stderr


BODY_CASES = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x",'),
    ("/v1/completions", b'[1, 2]'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"a": 1}}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}'),
    ("/tokenize", b'{"model": "tiny", "prompt": 5}'),
    ("/detokenize", b'{"model": "tiny", "tokens": "abc"}'),
]


@pytest.mark.parametrize("path,body", BODY_CASES)
def test_worker_check_answers_as_the_route_does(server: ServerProcess, path: str, body: bytes) -> None:
    """The large-body check gives the very 400 the route gives to the same (small) body."""
    from pagoda.entrypoints.openai.body_check import check_body
    from pagoda.entrypoints.openai.server import CHECKED_BODIES

    model = CHECKED_BODIES[path]
    message, param = check_body(None, f"{model.__module__}:{model.__qualname__}", body)
    resp = httpx.post(server.base_url + path, content=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert resp.status_code == 400
    assert (resp.json()["error"]["message"], resp.json()["error"]["param"]) == (message, param)


def test_large_invalid_body_is_refused_by_the_worker(server: ServerProcess) -> None:
    """A 2 MiB body with a bad field: a 400 naming it, from a worker process the server starts."""
    import psutil

    def workers() -> int:
        return sum("pagoda.sandbox" in " ".join(p.cmdline()) for p in psutil.Process(server.proc.pid).children())

    before = workers()
    body = {"model": "tiny", "prompt": "x" * (2 << 20), "temperature": "hot"}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature", resp.text
    assert workers() == before + 1
    ok = {"model": "tiny", "prompt": "x" * 400, "max_tokens": 2, "user": "y" * (1 << 20)}
    resp = httpx.post(server.base_url + "/v1/completions", json=ok, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200, resp.text  # a valid large body goes on to the route
