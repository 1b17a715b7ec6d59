"""Pieces shared by the completion and chat handlers: errors in OpenAI's shape, logprob
formatting, usage, server-sent events, and waiting on a client that may go away."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.async_engine import (AsyncEngine, EngineDeadError, PromptInput, RequestFailedError, RequestGroup,
                                        RequestTimeoutError)
from pagoda.engine.tracing import trace_headers
from pagoda.entrypoints.openai import protocol
from pagoda.entrypoints.openai.protocol import (MAX_UNKNOWN_NAMED, NOOP_FIELDS, ChatTokenLogprob, ChatTopLogprob,
                                                CompletionLogprobs, ErrorInfo, ErrorResponse, PromptLogprob,
                                                PromptLogprobs, PromptTokensDetails, RequestModel, SamplingRequest,
                                                Usage, pop_unknown_fields)
from pagoda.entrypoints.openai.tenants import TenantPolicy
from pagoda.lora.request import LoRARequest
from pagoda.outputs import Logprobs, RequestOutput
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.serving_lora import LoRARegistry

T = TypeVar("T")
logger = logging.getLogger(__name__)

# How often a non-streaming handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5
# Seconds a client is told to wait (``Retry-After``) after its request's deadline passed in the queue.
QUEUE_TIMEOUT_RETRY_AFTER_S = 1

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                503: "service_unavailable_error"}
_PARAM_NAME = re.compile(r"^(\w+)\b")


class APIError(Exception):
    """An error to return to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers  # extra response headers (a 503's Retry-After)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def invalid_request(exc: ValueError, known_params: set[str], default_param: str | None = None,
                    renames: dict[str, str] | None = None) -> APIError:
    """A 400 for a ``ValueError``: ``param`` is the field a ``ParamError`` names, else the
    parameter the message starts with. ``renames`` maps engine names to the request's (chat's
    ``top_logprobs`` is the engine's ``logprobs``)."""
    message = str(exc)
    param = getattr(exc, "param", None)
    if param is None:
        match = _PARAM_NAME.match(message)
        param = match.group(1) if match and match.group(1) in known_params else default_param
    renamed = (renames or {}).get(param, param) if param is not None else None
    if renamed != param:
        message = rename_in_message(message, param, renamed)
    return APIError(400, message, param=renamed)


def rename_in_message(message: str, name: str, field: str) -> str:
    """``message`` speaking of the field the client sent (``field``) where the engine said
    ``name``: a field-like name (``max_tokens``) wherever it stands ("lower max_tokens to ..."),
    a plain word (``prompt``) only as the message's subject, its first word."""
    if "_" in name:
        return re.sub(rf"\b{re.escape(name)}\b", field, message)
    return field + message[len(name):] if message.startswith(f"{name} ") else message


def _error_response(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# Every error status the server sends, with OpenAI's error body; routes pick theirs with
# ``error_responses``. (422 is never sent: invalid bodies are 400s.)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error_response("Invalid request: malformed JSON, a wrong type, a value out of range or an "
                         "unsupported field; param names the field"),
    401: _error_response("Missing or wrong API key (only when the server runs with --api-key)"),
    404: _error_response("The requested model is not served here"),
    413: _error_response("The request body is too large"),
    429: _error_response("The server is at capacity; retry later"),
    500: _error_response("Internal error (details are in the server log, never in the response)"),
    503: _error_response("The engine is not available"),
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route for the error statuses it can send."""
    return {code: ERROR_RESPONSES[code] for code in codes}


# One server-sent event as OpenAPI 3.1 documents an event stream (the schema describes each
# event): its data is a chunk's JSON, an error body, or the final "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def streamed_200(model: type[BaseModel], chunk: str) -> dict[str, Any]:
    """The 200 of a generation route: ``model`` as JSON, or server-sent events with ``stream``."""
    return {"model": model, "description": f"The {model.__name__}; with \"stream\": true, server-sent events "
            f"whose data is a {chunk} as JSON (an ErrorResponse if generation fails midway), then [DONE]",
            "content": {"text/event-stream": {"schema": _SSE_EVENT}}}


def finish_openapi(schema: dict[str, Any], strict_fields: bool = False) -> dict[str, Any]:
    """Make FastAPI's document say what the server does: no 422 (invalid bodies are 400s),
    every error status is an ``ErrorResponse`` in JSON, the models' schemas keep their exact
    integer bounds (FastAPI's document model stores them as floats: 2**64 - 1 would round up),
    and request bodies admit other properties unless ``strict_fields`` refuses them."""
    error_content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            for status, response in responses.items():
                if status[:1] in "45":
                    response["content"] = dict(error_content)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for name in components:
        model = getattr(protocol, name, None)
        if isinstance(model, type) and issubclass(model, BaseModel):
            mode = "validation" if issubclass(model, RequestModel) else "serialization"
            exact = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
            exact.pop("$defs", None)
            if mode == "validation":
                exact["additionalProperties"] = not strict_fields
            components[name] = exact
    return schema


# Location parts pydantic adds for union members and wrapped validators ("str",
# "list[int]", "function-after[...]"): not field names, so not part of a param's path.
_FIELD_PART = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _type_mismatch(error: dict[str, Any]) -> bool:
    """Whether pydantic's ``error`` says the input is not of the member's type at all (rather
    than of the type but out of its bounds)."""
    kind = str(error.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind in (
        "literal_error", "union_tag_invalid", "union_tag_not_found", "model_attributes_type", "is_instance_of")


def _field_path(loc: tuple) -> list[str | int]:
    parts: list[str | int] = []
    for part in loc:
        if isinstance(part, int) or (_FIELD_PART.fullmatch(part) and part not in _TYPE_TAGS):
            parts.append(part)
    return parts[1:] if parts[:1] == ["body"] else parts


def _path_text(path: list[str | int]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _got(value: Any) -> str:
    """The offending value, if it is short enough to quote."""
    if value is None or isinstance(value, (bool, int, float, str)):
        quoted = json.dumps(value)
        if len(quoted) <= 60:
            return f" (got {quoted})"
    return ""


def validation_error_of(errors: Sequence[dict[str, Any]]) -> APIError:
    """A 400 for pydantic's errors: one message about the first field at fault (its most
    specific error, when union members each complained), ``param`` that field."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    paths = [_field_path(tuple(e.get("loc", ()))) for e in errors]
    if not paths[0]:
        return APIError(400, "the request body must be a JSON object (with Content-Type: application/json)")
    field = paths[0][0]
    # Among a union's complaints about the field, the member whose type fits the input says what
    # is wrong (a bound, a length): errors past the type check first, then the deepest.
    same = [(not _type_mismatch(errors[i]), len(path), -i) for i, path in enumerate(paths) if path and path[0] == field]
    best = -max(same)[2]
    error, path = errors[best], paths[best]
    where = _path_text(path)
    noop = next((i for i, p in enumerate(path) if isinstance(p, str) and p in NOOP_FIELDS), None)
    if noop is not None:
        name = path[noop]
        message = (f"unsupported value for '{_path_text(path[:noop + 1])}': pagoda does not implement it; only "
                   f"{NOOP_FIELDS[name]} is accepted")
    else:
        message = f"{where}: {error.get('msg')}{_got(error.get('input'))}"
    others = len({str(p[:1]) for p in paths if p}) - 1
    if others > 0:
        message += f" (and {others} more field{'s' if others > 1 else ''} with problems)"
    return APIError(400, message, param=str(field))


class FieldPolicy:
    """What becomes of a request's fields that no model declares (vLLM's policy by default):
    ignored, with one warning per request naming them; with ``strict`` (the server's
    ``--strict-request-fields``) a 400 naming the first. Every route with a body calls
    ``check`` before it uses the body."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def check(self, req: RequestModel) -> None:
        """Drop (and name in the log) or refuse the fields of ``req`` that no model declares."""
        unknown = pop_unknown_fields(req)
        if not unknown:
            return
        if self.strict:
            param = unknown[0].split(".")[0].split("[")[0]
            raise APIError(400, f"unsupported field '{unknown[0]}': pagoda does not implement it", param=param)
        named = ", ".join(repr(name[:64]) for name in unknown[:MAX_UNKNOWN_NAMED])
        more = f" and {len(unknown) - MAX_UNKNOWN_NAMED} more" if len(unknown) > MAX_UNKNOWN_NAMED else ""
        logger.warning("ignored request fields pagoda does not know: %s%s", named, more)


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
    """The text of single tokens, as logprobs show them, and their bytes (cached: the vocabulary
    is finite)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._vocab_bytes: Any = None  # llguidance's view of the vocabulary, made on first use; False: none

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's logprob ``bytes``): a character split over several
        tokens has its bytes spread over them, where the token's text is U+FFFD. Read from the
        vocabulary as llguidance reads it (byte-level and byte-fallback vocabularies alike); the
        text's UTF-8 where the tokenizer gives no such view."""
        found = self._bytes.get(token_id)
        if found is None:
            raw = None
            if self._vocab_bytes is None:
                try:
                    import llguidance.hf

                    self._vocab_bytes = llguidance.hf.from_tokenizer(self.tokenizer)
                except Exception:  # noqa: BLE001 - a slow or unusual tokenizer: the text's bytes
                    self._vocab_bytes = False
            # (A padded vocabulary's rows past the tokenizer's have no bytes of their own.)
            if self._vocab_bytes and 0 <= token_id < self._vocab_bytes.vocab_size:
                raw = self._vocab_bytes.decode_bytes([token_id])
            found = self._bytes[token_id] = list(raw if raw is not None else self(token_id).encode())
        return found


def _ranked(logprobs: Logprobs) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: -item[1])


def completion_logprobs(token_ids: list[int], logprobs: list[Logprobs | None], text: TokenText,
                        offset: int, top_k: int | None = None) -> CompletionLogprobs:
    """Legacy completions logprobs; ``offset`` is where the first token's text starts.
    ``top_logprobs`` holds the top-k and the chosen token (so up to k + 1 entries); ``top_k``
    trims positions that carry more (prompt positions computed for a larger prompt_logprobs)."""
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
        ranked = _ranked(position)
        if top_k is not None and len(ranked) > top_k + 1:
            ranked = ranked[:top_k] + [(t, lp) for t, lp in ranked[top_k:] if t == token_id]
        for t, lp in ranked:
            top.setdefault(text(t), lp)  # tokens with the same text: keep the likelier
        out.top_logprobs.append(top)
    return out


def prompt_logprobs_body(out: RequestOutput, top_k: int, text: TokenText) -> PromptLogprobs | None:
    """``prompt_logprobs`` of a response (vLLM's shape): per prompt position the prompt token and
    the ``top_k`` likeliest, each with its logprob, rank (the top k: 1..k; the prompt token's
    from the engine) and text; null for the first position."""
    if out.prompt_logprobs is None:
        return None
    ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
    body: PromptLogprobs = []
    for token_id, position, rank in zip(out.prompt_token_ids, out.prompt_logprobs, ranks):
        if position is None:
            body.append(None)
            continue
        ranked = _ranked(position)[:top_k] if top_k else []
        entry = {t: PromptLogprob(logprob=lp, rank=r, decoded_token=text(t)) for r, (t, lp) in enumerate(ranked, 1)}
        if token_id not in entry:
            entry = {token_id: PromptLogprob(logprob=position[token_id], rank=rank, decoded_token=text(token_id)),
                     **entry}
        body.append(entry)
    return body


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
        top = [ChatTopLogprob(token=text(t), logprob=lp, bytes=text.bytes(t)) for t, lp in _ranked(position)[:top_k]]
        content.append(ChatTokenLogprob(token=token, logprob=position.get(token_id, float("-inf")),
                                        bytes=text.bytes(token_id), top_logprobs=top))
    return content


# The ASGI scope key a request made inside the server (a Batch API line) sets to run in the
# scheduler's background class (scheduler/background.py). HTTP requests never carry it.
BACKGROUND_SCOPE_KEY = "pagoda.background"


class Serving:
    """What every generation endpoint needs: the engine, the served name, token texts."""

    # Names a ValueError message may start with, reported as the error's ``param``.
    KNOWN_PARAMS = set(SamplingParams.__dataclass_fields__) | {
        "prompt", "messages", "max_completion_tokens", "top_logprobs", "echo", "suffix", "logit_bias", "model",
        "response_format", "tools", "tool_choice"}

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.token_text = TokenText(engine.tokenizer)
        self.loras: LoRARegistry | None = None  # served LoRA adapters (with --enable-lora)
        self.fields = FieldPolicy()  # the server's policy for unknown request fields
        self.tenants = TenantPolicy()  # the server's --tenant-id-source and --tenant-cache-isolation

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); a 404 for a name not served."""
        if self.loras is not None:
            return self.loras.resolve(name)
        if name and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return None

    def tag(self, prompts: list[PromptInput], req: SamplingRequest, raw: Request) -> None:
        """Set each prompt's tenant and prefix-cache salt (``TenantPolicy``), its priority,
        deadline and class (background for a batch line: ``BACKGROUND_SCOPE_KEY``), and the
        client's trace context when the server traces requests. A priority other than 0 is a 400
        unless the engine schedules by priority (as vLLM)."""
        tenant = self.tenants.tenant(raw, req.user)
        salt = self.tenants.cache_salt(tenant, req.cache_salt)
        priority, timeout = getattr(req, "priority", 0), getattr(req, "timeout", None)
        if priority != 0 and self.engine.config.scheduler.policy != "priority":
            raise APIError(400, f"priority {priority} needs a server started with --scheduling-policy priority "
                           f"(this one schedules by {self.engine.config.scheduler.policy}); leave it 0",
                           param="priority")
        headers = trace_headers(raw.headers) if self.engine.tracer is not None else None
        for prompt in prompts:
            prompt.tenant, prompt.cache_salt = tenant, salt
            prompt.priority, prompt.timeout, prompt.trace_headers = priority, timeout, headers
            prompt.background = bool(raw.scope.get(BACKGROUND_SCOPE_KEY, False))

    def served_name(self, name: str | None) -> str:
        """The ``model`` of a response: the adapter's name when the request chose one."""
        return name if name and self.loras is not None and name in self.loras.adapters else self.model_name

    @property
    def model_defaults(self) -> dict[str, Any]:
        """The model's generation-config sampling defaults (``--generation-config``): what a
        request's unset sampling fields take."""
        return self.engine.config.model.generation_defaults

    def default_max_tokens(self, prompt_len: int) -> int:
        """A request's output budget when it sets none: the rest of the context (at least 1, so an
        over-long prompt is refused as such), at most the model's ``max_new_tokens`` (vLLM's rule)."""
        room = max(1, self.engine.max_model_len - prompt_len)
        return min(room, self.model_defaults.get("max_tokens", room))

    def bad_request(self, exc: ValueError, default_param: str | None = None,
                    renames: dict[str, str] | None = None) -> APIError:
        return invalid_request(exc, self.KNOWN_PARAMS, default_param, renames)

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

    async def start(self, request_id: str, prompts: list[PromptInput], default_param: str,
                    renames: dict[str, str] | None = None) -> RequestGroup:
        """Send the prompts to the engine; refusals become 400s, a dead engine a 503."""
        try:
            return await self.engine.add_requests(request_id, prompts)
        except ValueError as exc:
            raise self.bad_request(exc, default_param, renames) from exc
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from exc


def engine_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"the engine is not available: {exc}", code="engine_unavailable")


def failure(exc: BaseException) -> APIError:
    """The API error for something that ended a request after it started."""
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(exc)
    if isinstance(exc, RequestTimeoutError):
        return APIError(503, str(exc), code="queue_timeout",
                        headers={"Retry-After": str(QUEUE_TIMEOUT_RETRY_AFTER_S)})
    if isinstance(exc, ValueError):
        # The engine core's refusal of the request (a RequestError with a 4xx status): its
        # message is written for the client.
        return APIError(400, str(exc))
    if isinstance(exc, RequestFailedError):
        return APIError(500, "the engine failed while generating this request; it was ended (other requests "
                        "are unaffected)", code="request_failed")
    # Never the exception's text: it may carry internals. The server log has the details.
    logger.error("request failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, "internal server error", code="internal_error")
