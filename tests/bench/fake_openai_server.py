"""A tiny OpenAI-compatible streaming server for testing the bench client.

It generates no text worth reading: each request streams exactly
``max_tokens`` tokens ("tok0 tok1 ..."), ``tokens_per_chunk`` per SSE chunk,
sleeping ``token_delay`` seconds per chunk, then reports ``usage``. Every
received body is recorded so that tests can check what the client sent.
Runs under uvicorn in a daemon thread, bound to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"


@dataclass
class FakeConfig:
    token_delay: float = 0.001  # seconds between chunks
    first_token_delay: float = 0.005  # extra "prefill" wait before the first chunk
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0  # every Nth request gets HTTP 500; 0 = never
    requests: list[dict[str, Any]] = field(default_factory=list)
    completion_tokens_sent: list[int] = field(default_factory=list)


def _prompt_tokens(body: dict[str, Any]) -> int:
    """Stand-in tokenizer: ids count as tokens, text is split on spaces."""
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"id": "x", "object": "chunk", "model": MODEL_ID, "choices": [choice]}


async def _stream(cfg: FakeConfig, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
    n = int(body.get("max_tokens") or 16)
    if chat:  # real servers open chat streams with a role-only delta
        yield _sse({"id": "x", "model": MODEL_ID, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    await asyncio.sleep(cfg.first_token_delay)
    sent = 0
    while sent < n:
        k = min(cfg.tokens_per_chunk, n - sent)
        text = "".join(f"tok{sent + j} " for j in range(k))
        sent += k
        yield _sse(_chunk(chat, text, "length" if sent == n else None))
        await asyncio.sleep(cfg.token_delay)
    cfg.completion_tokens_sent.append(sent)
    if cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
        p = _prompt_tokens(body)
        yield _sse({"id": "x", "model": MODEL_ID, "choices": [], "usage": {
            "prompt_tokens": p, "completion_tokens": sent, "total_tokens": p + sent}})
    yield "data: [DONE]\n\n"


def make_app(cfg: FakeConfig) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        cfg.requests.append(body)
        if cfg.fail_every and len(cfg.requests) % cfg.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        return StreamingResponse(_stream(cfg, body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


class FakeOpenAIServer:
    """Context manager: ``with FakeOpenAIServer() as srv: srv.base_url``."""

    def __init__(self, cfg: FakeConfig | None = None) -> None:
        self.cfg = cfg or FakeConfig()
        # proto must be IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on
        # accepted sockets whose proto says TCP, and with Nagle on, small SSE
        # chunks get coalesced and delayed ~40 ms, which would wreck the timings.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Bind port 0 ourselves and hand the socket to uvicorn: no race for a port.
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        # asyncio's loop, not uvloop (uvicorn's pick when installed): uvloop's timers count whole
        # milliseconds and may fire a fraction of one early, under the delays tests assert.
        config = uvicorn.Config(make_app(self.cfg), log_level="warning", access_log=False, loop="asyncio")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._sock.close()
