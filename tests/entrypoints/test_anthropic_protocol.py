"""The Messages API's pieces without an engine: the translation of a conversation into chat
messages, the request models' field policy, and Anthropic's error shape on the Messages paths
(a small app with the real routes' middleware and the server's admission handlers)."""
from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from pydantic_core import from_json

from pagoda.engine.core_client import EngineOverloadedError
from pagoda.entrypoints.anthropic.protocol import MessagesRequest
from pagoda.entrypoints.anthropic.routes import wrap_outermost
from pagoda.entrypoints.anthropic.serving import MessagesServing, chat_request
from pagoda.entrypoints.openai.serving_common import FieldPolicy
from pagoda.entrypoints.openai import admission
from pagoda.entrypoints.openai.serving_common import APIError
from pagoda.entrypoints.openai.structured import ToolPlan
from pagoda.outputs import CompletionOutput


def request(**kw: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_conversation_becomes_chat_messages() -> None:
    req = request(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "before "},
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r1"}],
             "is_error": True},
            {"type": "text", "text": "after"}]}],
        tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "f"},
        stop_sequences=["END"], top_k=3)
    chat = chat_request(req)
    messages = [m.template_input() for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "user", "content": "before "},
        {"role": "tool", "content": "r1", "tool_call_id": "t1"},
        {"role": "user", "content": "after"}]
    assert chat.tool_choice.function.name == "f" and chat.tools[0].function.parameters == {"type": "object"}
    assert (chat.stop, chat.top_k, chat.max_tokens) == (["END"], 3, 8)


@pytest.mark.parametrize("choice,chat_choice,parallel", [
    ({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False), ({"type": "none"}, "none", None)])
def test_tool_choice(choice: dict, chat_choice: str, parallel: bool | None) -> None:
    chat = chat_request(request(messages=[{"role": "user", "content": "x"}], tool_choice=choice,
                                tools=[{"name": "f", "input_schema": {"type": "object"}}]))
    assert (chat.tool_choice, chat.parallel_tool_calls) == (chat_choice, parallel)


def test_unknown_fields_are_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    req = request(messages=[{"role": "user", "content": [{"type": "text", "text": "x",
                                                         "cache_control": {"type": "ephemeral"}}]}],
                  container="c", output_format=None, metadata={"user_id": "u", "tag": 1})
    with caplog.at_level(logging.WARNING):
        FieldPolicy().check(req)
    assert req.model_extra == {} and req.messages[0].content[0].model_extra == {}
    assert ("'container', 'output_format', 'messages[0].content[0].cache_control', 'metadata.tag'"
            in caplog.text)
    caplog.clear()
    FieldPolicy().check(request(messages=[{"role": "user", "content": "x"}]))
    assert caplog.text == ""


@pytest.mark.parametrize("bad", [{"max_tokens": "8"}, {"max_tokens": 0}, {"temperature": True},
                                 {"top_p": 0}, {"stream": 1}, {"stop_sequences": [""]},
                                 {"messages": [{"role": "system", "content": "x"}]},
                                 {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}])
def test_known_fields_are_strict(bad: dict) -> None:
    with pytest.raises(ValidationError):
        request(**{"messages": [{"role": "user", "content": "x"}], **bad})


def app_with(route: Any) -> TestClient:
    """The server's arrangement: error handlers, the Messages wrapper, then admission's
    middleware added after it (as the server does)."""
    app = FastAPI()

    @app.exception_handler(APIError)
    async def api_error(request: Any, exc: APIError) -> Any:
        return exc.response()

    @app.exception_handler(Exception)
    async def unexpected(request: Any, exc: Exception) -> Any:
        return APIError(500, "internal server error").response()

    for path in ("/v1/messages", "/v1/chat/completions"):
        app.post(path)(route)
    wrap_outermost(app)
    admission.install(app, 1 << 10, lambda status: None)
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("exc,status,kind", [
    (APIError(400, "bad"), 400, "invalid_request_error"), (APIError(401, "key"), 401, "authentication_error"),
    (APIError(404, "model"), 404, "not_found_error"), (EngineOverloadedError("full"), 429, "rate_limit_error"),
    (APIError(503, "engine"), 503, "overloaded_error"), (RuntimeError("secret internals"), 500, "api_error"),
    (None, 413, "request_too_large")])
def test_errors_have_anthropic_shape_on_messages_paths_only(exc: Exception | None, status: int, kind: str) -> None:
    """Made by the handler, the app's handlers, the last-resort handler or the body limit (None:
    a body over the 1 KiB limit) alike."""
    async def fail() -> None:
        raise exc  # type: ignore[misc]

    client = app_with(fail)
    payload = {"x": "y" * 2000} if exc is None else {}
    response = client.post("/v1/messages", json=payload)
    assert response.status_code == status
    body = response.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    assert "secret" not in body["error"]["message"]
    assert int(response.headers["content-length"]) == len(response.content)
    if status == 429:
        assert response.headers["retry-after"] == "1"
    other = client.post("/v1/chat/completions", json=payload)
    assert other.status_code == status and "type" not in other.json() and "message" in other.json()["error"]


class _Group:
    """A finished request's changes, as ``RequestGroup.changes`` yields them (text deltas)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.states = [SimpleNamespace(num_cached_tokens=0, prompt_token_ids=[1, 2],
                                       samples=[SimpleNamespace(token_ids=list(range(len(pieces))))])]

    async def changes(self) -> Any:
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield 0, SimpleNamespace(outputs=[CompletionOutput(0, piece, [i], finish_reason="length" if last else None)])


def _assembled(events: list[str]) -> list[dict[str, Any]]:
    """The content blocks a client builds from the stream (partial JSON input, as the SDK reads it)."""
    blocks: list[dict[str, Any]] = []
    for e in events:
        data = json.loads(e.split("data: ", 1)[1])
        if data["type"] == "content_block_start":
            blocks.append(dict(data["content_block"], _json=""))
        elif data["type"] == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[-1]["text"] += delta["text"]
            else:
                blocks[-1]["_json"] += delta["partial_json"]
    for b in blocks:
        raw = b.pop("_json")
        if b["type"] == "tool_use":
            b["input"] = from_json(raw or "{}", allow_partial=True)
        b.pop("id", None)
    return blocks


@pytest.mark.parametrize("cut", [8, 24, 36, 44, 60])
@pytest.mark.parametrize("split", ["one-change", "each-char", "last-piece-names-the-call"])
def test_a_forced_call_cut_short_streams_as_the_whole_answer(cut: int, split: str) -> None:
    """Ended by max_tokens, the streamed blocks equal the whole answer's, however the engine's
    output was split into changes (under load, one change may carry the whole output)."""
    text = '[{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}]'[:cut]
    pieces = {"one-change": [text], "each-char": list(text),
              "last-piece-names-the-call": [text[:2], text[2:]]}[split]
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    plan = ToolPlan("required", [weather])
    serving = MessagesServing(SimpleNamespace(reasoning=None))  # type: ignore[arg-type]

    async def stream() -> list[str]:
        return [e async for e in serving._stream(_Group(pieces), "msg_1", "m", plan)]  # type: ignore[arg-type]

    events = asyncio.run(stream())
    whole, _ = serving._content(CompletionOutput(0, text, [0], finish_reason="length"), plan)
    expected = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in whole]
    assert _assembled([e for e in events if "content_block" in e]) == expected
    assert any(b["type"] == "tool_use" for b in expected) == (cut >= 36)
