"""The Messages API's routes on the server's app, and Anthropic's error shape for them.

``install(app, chat, dependencies)`` adds ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` behind the same dependencies (the API key check) as the
OpenAI routes. Every error these paths answer, wherever in the app it is made (body
size, body validation, the key check, the handler, the queue bound, an unexpected failure),
leaves as
``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for the status: a
small ASGI middleware around the whole app rewrites the server's OpenAI-shaped error bodies on
these paths only.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.anthropic.protocol import (CountTokensRequest, CountTokensResponse, MessagesErrorResponse,
                                                   MessagesRequest, MessagesResponse)
from pagoda.entrypoints.anthropic.serving import MessagesServing, error_body
from pagoda.entrypoints.openai.serving_chat import ChatServing

PREFIX = "/v1/messages"
_SSE_EVENT = {"type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": MessagesErrorResponse, "description": "An error in Anthropic's shape"} for code in codes}


def install(app: FastAPI, chat: ChatServing, dependencies: Sequence[Depends], auth: bool) -> None:
    """Serve the Messages API on ``app`` through the chat route's ``chat``."""
    serving = MessagesServing(chat)
    router = APIRouter()
    errors = (400, *((401,) if auth else ()), 404, 413, 500)

    @router.post(PREFIX, response_model=None, responses={
        200: {"model": MessagesResponse, "description": "The MessagesResponse; with \"stream\": true, server-sent "
              "events in Anthropic's order (message_start ... message_stop)",
              "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
        **_errors(*errors, 429, 503)})
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await serving.create(req, raw)

    @router.post(PREFIX + "/count_tokens", responses=_errors(*errors))
    async def count_tokens(req: CountTokensRequest, raw: Request) -> CountTokensResponse:
        return await serving.count_tokens(req, raw)

    app.include_router(router, dependencies=list(dependencies))
    wrap_outermost(app)
    _document_errors(app)


def wrap_outermost(app: FastAPI) -> None:
    """Put ``AnthropicErrors`` around the whole app, outside every middleware, those added
    later included (the body limit's 413, the last-resort 500 handler): Starlette builds the
    stack on the first request from ``build_middleware_stack``."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: AnthropicErrors(build())  # type: ignore[method-assign]


class AnthropicErrors:
    """Rewrite the OpenAI-shaped JSON error bodies (``{"error": {"message", ...}}``) of the
    Messages paths into Anthropic's shape; everything else passes untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        body = bytearray()

        async def rewriting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] < 400 or not _is_json(message):
                    await send(message)
                    return
                start.update(message)  # held until the body is complete
                return
            if not start or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            new_body = _rewritten(start["status"], bytes(body))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body})

        await self.app(scope, receive, rewriting_send)


def _is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _is_json(message: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json")
               for k, v in message.get("headers", []))


def _rewritten(status: int, body: bytes) -> bytes:
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body  # not the server's error shape: leave it
    return json.dumps(error_body(status, str(message))).encode()


def _document_errors(app: FastAPI) -> None:
    """The OpenAPI document's error bodies of the Messages paths are Anthropic's (the server's
    own document step gives every path OpenAI's)."""
    previous: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = previous()
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/MessagesErrorResponse"}}}
        for path, item in schema.get("paths", {}).items():
            if not _is_messages_path(path):
                continue
            for operation in item.values():
                for status, response in operation.get("responses", {}).items():
                    if status[:1] in "45":
                        response["content"] = dict(ref)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.setdefault("MessagesErrorResponse", MessagesErrorResponse.model_json_schema())
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
