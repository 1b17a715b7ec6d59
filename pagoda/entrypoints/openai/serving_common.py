"""Pieces shared by the completion and chat handlers: errors in OpenAI's shape, logprob
formatting, usage, server-sent events, and waiting on a client that may go away."""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.core_client import AsyncEngine, EngineDeadError, PromptInput, RequestFailedError, RequestGroup
from pagoda.entrypoints.openai.protocol import (ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, ErrorInfo,
                                                ErrorResponse, PromptTokensDetails, Usage)
from pagoda.outputs import Logprobs
from pagoda.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

# How often a non-streaming handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                503: "service_unavailable_error"}
_PARAM_NAME = re.compile(r"^(\w+)\b")


class APIError(Exception):
    """An error to return to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def invalid_request(exc: ValueError, known_params: set[str], default_param: str | None = None) -> APIError:
    """A 400 for a ``ValueError`` whose message starts with the parameter it is about."""
    message = str(exc)
    match = _PARAM_NAME.match(message)
    param = match.group(1) if match and match.group(1) in known_params else default_param
    return APIError(400, message, param=param)


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await ``awaitable``, polling the connection; raise ``ClientDisconnected`` (after
    cancelling the work) if the client goes away first."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events that always run ``on_close`` when the response ends, however it
    ends (finished, client gone, server shutting down), so the engine never keeps working
    for nobody."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
            await self._on_close()


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {error.body().model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_of(group: RequestGroup) -> Usage:
    """Token counts of a whole API call: each prompt once, every sample's output."""
    prompt = sum(len(s.prompt_token_ids) for s in group.states)
    completion = sum(len(sample.token_ids) for s in group.states for sample in s.samples)
    cached = sum(s.num_cached_tokens for s in group.states)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TokenText:
    """The text of single tokens, as logprobs show them (cached: the vocabulary is finite)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _ranked(logprobs: Logprobs) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: -item[1])


def completion_logprobs(token_ids: list[int], logprobs: list[Logprobs | None], text: TokenText,
                        offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs; ``offset`` is where the first token's text starts.
    ``top_logprobs`` holds the top-k and the chosen token (so up to k + 1 entries)."""
    out = CompletionLogprobs()
    for token_id, position in zip(token_ids, logprobs):
        token = text(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if position is None:  # the first prompt token has nothing before it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(position.get(token_id))
        top: dict[str, float] = {}
        for t, lp in _ranked(position):
            top.setdefault(text(t), lp)  # tokens with the same text: keep the likelier
        out.top_logprobs.append(top)
    return out


def merge_completion_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)


def chat_logprobs(token_ids: list[int], logprobs: list[Logprobs], top_k: int,
                  text: TokenText) -> list[ChatTokenLogprob]:
    """Chat logprobs: the chosen token's, and the ``top_k`` most likely at each position."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        token = text(token_id)
        top = [ChatTopLogprob(token=text(t), logprob=lp, bytes=list(text(t).encode()))
               for t, lp in _ranked(position)[:top_k]]
        content.append(ChatTokenLogprob(token=token, logprob=position.get(token_id, float("-inf")),
                                        bytes=list(token.encode()), top_logprobs=top))
    return content


class Serving:
    """What every generation endpoint needs: the engine, the served name, token texts."""

    # Names a ValueError message may start with, reported as the error's ``param``.
    KNOWN_PARAMS = set(SamplingParams.__dataclass_fields__) | {
        "prompt", "messages", "max_completion_tokens", "top_logprobs", "echo", "suffix", "logit_bias", "model"}

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.token_text = TokenText(engine.tokenizer)

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def bad_request(self, exc: ValueError, default_param: str | None = None) -> APIError:
        return invalid_request(exc, self.KNOWN_PARAMS, default_param)

    async def collect(self, group: RequestGroup, raw: Request) -> list | Response:
        """Wait for a non-streamed request's outputs; a client gone meanwhile gets a 499 (its
        request is aborted either way)."""
        try:
            return await unless_disconnected(group.results(), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise failure(exc) from exc
        finally:
            await group.abort()

    async def start(self, request_id: str, prompts: list[PromptInput], default_param: str) -> RequestGroup:
        """Send the prompts to the engine; refusals become 400s, a dead engine a 503."""
        try:
            return await self.engine.add_requests(request_id, prompts)
        except ValueError as exc:
            raise self.bad_request(exc, default_param) from exc
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from exc


def engine_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"the engine is not available: {exc}", code="engine_unavailable")


def failure(exc: BaseException) -> APIError:
    """The API error for something that ended a request after it started."""
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(exc)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, RequestFailedError):
        return APIError(500, "the engine failed while generating this request; it was ended (other requests "
                        "are unaffected)", code="request_failed")
    # Never the exception's text: it may carry internals. The server log has the details.
    logger.error("request failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, "internal server error", code="internal_error")
