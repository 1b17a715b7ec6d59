"""The OpenAI-compatible API server (``pagoda serve``): FastAPI + uvicorn in this process, the
engine core in another (``engine/core_proc.py``), joined by ZMQ.

Start-up: resolve the config, spawn the engine core, wait for its ready message, then serve.
Faults: if the engine core dies, in-flight requests fail at once, ``/health`` turns 503 and
the server exits non-zero (for a supervisor to restart it). SIGINT/SIGTERM: stop accepting,
let in-flight requests finish for ``--shutdown-timeout`` seconds, abort the rest, stop the
engine core.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Iterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.config import EngineArgs
from pagoda.engine import gc_freeze
from pagoda.engine.async_engine import DEFAULT_STALL_TIMEOUT_S, AsyncEngine, EngineDeadError, EngineStartupError
from pagoda.engine.tracing import DEFAULT_PROTOCOL, PROTOCOLS
from pagoda.entrypoints import anthropic
from pagoda.entrypoints.openai import admission
from pagoda.entrypoints.openai.admission import (DEFAULT_AUTH_FAILURE_DELAY_S, DEFAULT_MAX_REQUEST_BODY_SIZE,
                                                 DEFAULT_REQUEST_BODY_TIMEOUT_S, INVALID_KEY_MESSAGE, key_matches)
from pagoda.entrypoints.openai.batch.routes import (add_batch_args, batch_routes, build_batch_service,
                                                   upload_body_limit)
from pagoda.entrypoints.openai.batch.service import BatchService
from pagoda.entrypoints.openai.batch.storage import StorageInUseError
from pagoda.entrypoints.openai.body_check import BodyChecker
from pagoda.entrypoints.openai.dashboard.history import DashboardHistory
from pagoda.entrypoints.openai.dashboard.routes import Dashboard, dashboard_routes
from pagoda.entrypoints.openai.connections import (DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                                                   DEFAULT_MAX_REQUEST_HEADER_SIZE, DEFAULT_REQUEST_HEADER_TIMEOUT_S,
                                                   ConnectionLimits, protocol_factory)
from pagoda.entrypoints.openai.metrics import METRICS_COMPAT_CHOICES, ServerMetrics
from pagoda.entrypoints.openai.models_config import add_models_args, fold_single_model
from pagoda.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                HealthResponse, ModelCard, ModelList, RequestModel,
                                                TokenizeRequest, TokenizeResponse, VersionResponse)
from pagoda.entrypoints.openai.reasoning import (REASONING_PARSERS, TOOL_FORMAT_REASONING, ReasoningParser,
                                                 get_reasoning_parser)
from pagoda.entrypoints.openai.serving_chat import ChatServing, prompt_ids, render_chat
from pagoda.entrypoints.openai.serving_common import (APIError, FieldPolicy, engine_unavailable, error_responses,
                                                      finish_openapi, streamed_200, validation_error_of)
from pagoda.entrypoints.openai.serving_completion import CompletionServing
from pagoda.entrypoints.openai.serving_embedding import EmbeddingRequest, EmbeddingResponse, EmbeddingServing
from pagoda.entrypoints.openai.serving_responses import (DEFAULT_MAX_STORED_RESPONSES, ResponsesServing,
                                                         add_responses_args, responses_routes)
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, resolve_tool_parser
from pagoda.entrypoints.openai.serving_lora import LoRARegistry, add_lora_args, check_lora_args, lora_routes
from pagoda.entrypoints.openai.stat_logger import StatLogger
from pagoda.entrypoints.openai.tenants import TenantPolicy, add_tenant_args, tenant_policy
from pagoda.multimodal.media import ImageLoader
from pagoda.entrypoints.argtypes import (non_negative_byte_size as _parse_size, non_negative_float as _non_negative_float,
                                         non_negative_int as _non_negative_int, positive_float as _positive_float)

logger = logging.getLogger("pagoda.server")

DEMO_MODEL_NAME = "pagoda-demo"
# After the engine core dies the server keeps answering (with 503s) this long before it exits,
# so health probes and load balancers see why it is going away.
DEATH_EXIT_DELAY_S = 1.0
# Requests that may wait beyond those the engine runs at once (SGLang's --max-queued-requests).
DEFAULT_MAX_QUEUED_REQUESTS = 4096
# The routes whose large bodies are checked in a worker process before the route parses them.
CHECKED_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
EMPTY_API_KEY_ERROR = ("the API key is empty (--api-key '' or PAGODA_API_KEY=''): give a non-empty key, "
                       "or none to serve without one")


# ---- the app ---------------------------------------------------------------------------------

class APIServer:
    """Holds what the route handlers share. ``api_key`` None: no key needed; an empty key is
    refused (it would let an empty bearer token in)."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None, log_stats: bool = False,
                 metrics_compat: list[str] | tuple[str, ...] = (), tool_call_parser: str | None = None,
                 allow_runtime_lora_updating: bool = False, reasoning_parser: ReasoningParser | None = None,
                 strict_request_fields: bool = False, tenants: TenantPolicy | None = None,
                 max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, strict_tool_arguments: bool = True,
                 metrics: ServerMetrics | None = None) -> None:
        # ``metrics``: a metric set kept from an earlier engine of the same model (a model reloaded
        # by a several-models server), so its counters carry on.
        if api_key == "":
            raise ValueError(EMPTY_API_KEY_ERROR)
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        speculative = engine.config.speculative is not None
        lora = engine.config.lora
        self.metrics = metrics or ServerMetrics(model_name, speculative, compat=metrics_compat,
                                                max_loras=lora.max_loras if lora else None,
                                                priority_classes=engine.config.scheduler.policy == "priority")
        engine.listeners.append(self.metrics)
        self.stat_logger = StatLogger(speculative) if log_stats else None
        if self.stat_logger is not None:
            engine.listeners.append(self.stat_logger)
        self.completions = CompletionServing(engine, model_name)
        self.chat = ChatServing(engine, model_name, tool_call_parser, reasoning_parser)
        self.chat.strict_tool_arguments = strict_tool_arguments
        self.loras = LoRARegistry(engine, model_name, allow_runtime_lora_updating) if lora else None
        self.completions.loras = self.chat.loras = self.loras
        self.fields = FieldPolicy(strict_request_fields)
        self.completions.fields = self.chat.fields = self.fields
        self.completions.tenants = self.chat.tenants = tenants or TenantPolicy()
        # The dashboard's history hears the same hooks as the metrics (no work in the engine core).
        history = DashboardHistory()
        engine.listeners.append(history)
        self.dashboard = Dashboard(engine, model_name, history,
                                   hide_text=self.completions.tenants.cache_isolation)
        self.responses = ResponsesServing(self.chat, max_stored_responses)
        self.batches: BatchService | None = None  # the Files and Batch API (set by the server with its flags)
        pooler = engine.config.pooler
        self.embeddings = EmbeddingServing(engine, model_name, pooler) if pooler is not None else None
        if self.embeddings is not None:
            self.embeddings.loras, self.embeddings.fields, self.embeddings.tenants = \
                self.loras, self.fields, self.completions.tenants

    async def check_api_key(self, request: Request) -> None:
        """The routes' own check of the key. ``admission.RequestGuard`` refuses a request without
        it before its body is read; this keeps an app built without the guard closed too."""
        # async: FastAPI would run a plain function in a worker thread, a hop per request.
        if self.api_key is not None and not key_matches(request.headers.get("authorization", ""), self.api_key,
                                                        request.headers.get("x-api-key")):
            raise APIError(401, INVALID_KEY_MESSAGE, code="invalid_api_key")


def build_app(server: APIServer) -> FastAPI:
    app = FastAPI(title="pagoda", version=pagoda.__version__, docs_url=None, redoc_url=None)
    app.state.server = server
    _add_error_handlers(app, server)
    app.include_router(_public_routes(server))
    app.include_router(_api_routes(server), dependencies=[Depends(server.check_api_key)])
    for router in dashboard_routes(server.dashboard, [Depends(server.check_api_key)],
                                   (401,) if server.api_key else ()):
        app.include_router(router)
    app.include_router(responses_routes(server.responses, (401,) if server.api_key else ()),
                       dependencies=[Depends(server.check_api_key)])
    if server.engine.config.enable_sleep_mode:
        app.include_router(_sleep_routes(server), dependencies=[Depends(server.check_api_key)])
    if server.loras is not None and server.loras.allow_updates:
        app.include_router(lora_routes(server.loras, (401,) if server.api_key else (), server.fields),
                           dependencies=[Depends(server.check_api_key)])
    if server.batches is not None:
        app.include_router(batch_routes(server.batches, (401,) if server.api_key else (), server.fields),
                           dependencies=[Depends(server.check_api_key)])
        server.batches.attach(app)  # batch lines run through this app's own routes
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # FastAPI documents a 422 on every route with a body; this server answers 400 instead.
        if app.openapi_schema is None:
            app.openapi_schema = finish_openapi(default_openapi(), server.fields.strict)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # Anthropic's Messages API, behind the same key check.
    anthropic.install(app, server.chat, [Depends(server.check_api_key)], auth=server.api_key is not None)
    return app


def _public_routes(server: APIServer) -> APIRouter:
    """Probes and scrapers: open even with ``--api-key``."""
    router = APIRouter()
    engine = server.engine

    @router.get("/health", responses={200: {"model": HealthResponse}, **error_responses(500, 503)})
    async def health() -> Response:
        # Answers at once, however long the engine's current step: busy is healthy; only a
        # dead engine core, or one whose loop stopped turning, is not.
        try:
            engine.check_health()
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from exc
        return JSONResponse({"status": "ok", "engine_pid": engine.engine_pid})

    @router.get("/ping", responses={200: {"model": HealthResponse}, **error_responses(500, 503)})
    async def ping() -> Response:
        """The same answer as /health (the probe path of some load balancers)."""
        return await health()

    @router.post("/ping", responses={200: {"model": HealthResponse}, **error_responses(500, 503)})
    async def ping_post() -> Response:  # (its own route: one operation id per method)
        """The same answer as /health, to a POST (SageMaker's probe)."""
        return await health()

    @router.get("/version", response_model=VersionResponse, responses=error_responses(500))
    async def version() -> dict[str, Any]:
        return {"version": pagoda.__version__}

    @router.get("/metrics", response_class=PlainTextResponse,
                responses={200: {"description": "Prometheus text format"}, **error_responses(500)})
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    return router


def _api_routes(server: APIServer) -> APIRouter:
    router = APIRouter()
    engine = server.engine
    auth = (401,) if server.api_key else ()  # 401 only exists with --api-key
    body_errors = (400, *auth, 404, 413, 500)
    generation_errors = (*body_errors, 429, 503)

    @router.get("/v1/models", responses=error_responses(*auth, 500))
    async def models() -> ModelList:
        adapters = server.loras.cards(engine.max_model_len) if server.loras is not None else []
        return ModelList(data=[ModelCard(id=server.model_name, root=server.model_name,
                                         max_model_len=engine.max_model_len), *adapters])

    @router.get("/v1/models/{model_id:path}", responses=error_responses(*auth, 404, 500))
    async def model(model_id: str) -> ModelCard:
        card = next((c for c in (await models()).data if c.id == model_id), None)
        if card is None:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return card

    @router.post("/v1/completions", response_model=None,
                 responses={200: streamed_200(CompletionResponse, "CompletionResponse"),
                            **error_responses(*generation_errors)})
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions.create(req, raw)

    @router.post("/v1/chat/completions", response_model=None,
                 responses={200: streamed_200(ChatCompletionResponse, "ChatCompletionChunk"),
                            **error_responses(*generation_errors)})
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat.create(req, raw)

    if server.embeddings is not None:  # an embedding model (--task embed, or sentence-transformers files)
        @router.post("/v1/embeddings", response_model=None,
                     responses={200: {"model": EmbeddingResponse}, **error_responses(*generation_errors)})
        async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
            return await server.embeddings.create(req, raw)  # type: ignore[union-attr]

    @router.post("/tokenize", responses=error_responses(*body_errors))
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        server.completions.check_model(req.model)
        server.fields.check(req)
        ids = await _tokenize(engine, req, server.chat.images)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @router.post("/detokenize", responses=error_responses(*body_errors))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        server.completions.check_model(req.model)
        server.fields.check(req)
        vocab = engine.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=engine.detokenize(req.tokens))

    @router.get("/debug/engine", responses=error_responses(*auth, 500, 503))
    async def engine_stats() -> dict[str, Any]:
        """Engine-core state (KV blocks in use, queue lengths), asked between two steps."""
        try:
            return await engine.call_utility("stats")
        except (asyncio.TimeoutError, EngineDeadError) as exc:
            raise engine_unavailable(exc) from exc

    return router


# Seconds a sleep, wake-up or weight update may take in the engine core (a level-2 wake-up and
# an update load a whole checkpoint).
SLEEP_CALL_TIMEOUT_S = 600.0


class UpdateWeightsRequest(RequestModel):
    """``POST /update_weights``: the checkpoint directory to serve from now on."""

    model_path: str = Field(min_length=1, max_length=4096)


async def sleep_call(engine: AsyncEngine, method: str, args: list | None = None) -> Any:
    """A sleep-mode utility call on the engine core: its answer; a 400 carrying the engine's
    reason when it refuses (a bad level, another checkpoint's shapes), a 503 when it is gone."""
    try:
        return await engine.call_utility(method, SLEEP_CALL_TIMEOUT_S, args)
    except RuntimeError as exc:
        if isinstance(exc, EngineDeadError):
            raise engine_unavailable(exc) from exc
        raise APIError(400, str(exc).removeprefix("ValueError: ")) from exc
    except asyncio.TimeoutError as exc:
        raise engine_unavailable(exc) from exc


def _sleep_routes(server: APIServer) -> APIRouter:
    """Sleep mode (``--enable-sleep-mode``, vLLM's routes): /sleep?level=1|2, /wake_up,
    /is_sleeping, /reset_prefix_cache and /update_weights (SGLang's update_weights_from_disk)."""
    router = APIRouter()
    engine = server.engine
    errors = error_responses(400, *((401,) if server.api_key else ()), 500, 503)

    async def call(method: str, args: list | None = None) -> Any:
        return await sleep_call(engine, method, args)

    @router.post("/sleep", responses=errors)
    async def sleep(level: int = 1) -> dict[str, Any]:
        """Release the KV cache (level 1) or the weights too (level 2); requests wait until /wake_up."""
        return {"level": level, "released_bytes": await call("sleep", [level])}

    @router.post("/wake_up", responses=errors)
    async def wake_up() -> dict[str, Any]:
        await call("wake_up")
        return {"is_sleeping": False}

    @router.get("/is_sleeping", responses=errors)
    async def is_sleeping() -> dict[str, Any]:
        level = await call("is_sleeping")
        return {"is_sleeping": bool(level), "level": level}

    @router.post("/reset_prefix_cache", responses=errors)
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"evicted_blocks": await call("reset_prefix_cache")}

    @router.post("/update_weights", responses=errors)
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        """Serve another checkpoint of the same architecture and shapes; running requests are
        recomputed with it."""
        server.fields.check(req)
        await call("update_weights", [req.model_path])
        return {"model_path": req.model_path}

    return router


async def _tokenize(engine: AsyncEngine, req: TokenizeRequest, images_loader: ImageLoader) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    param = "messages" if req.messages is not None else "prompt"
    try:
        if req.messages is not None:
            # Rendered as /v1/chat/completions renders them (tools, template variables, ...).
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            _, text, images = await render_chat(engine, req, tools)
            ids, _, _ = await prompt_ids(engine, images_loader, text, images, bool(req.add_special_tokens))
            return ids
        engine.input_processor.check_text(len(req.prompt or ""))
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return await engine.tokenize(req.prompt or "", add_special)
    except ValueError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "param", None) or param) from exc


def _add_error_handlers(app: FastAPI, server: APIServer) -> None:
    """Every error leaves in OpenAI's shape; malformed or invalid bodies are 400s, not 422s."""

    def respond(error: APIError) -> JSONResponse:
        server.metrics.on_http_error(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route matched
            return respond(_not_served(request))
        response = respond(APIError(exc.status_code, str(exc.detail)))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The details stay in the server log: exception text can carry internals.
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return respond(APIError(500, "internal server error", code="internal_error"))


def _not_served(request: Request) -> APIError:
    """The 404 of a path no route serves (another API's, such as /v1/embeddings): says so,
    with the endpoints this server does serve."""
    served = ", ".join(sorted(request.app.openapi().get("paths", {})))  # the document is built once
    hint = ("; /v1/embeddings needs an embedding model (--task embed, or a checkpoint with "
            "sentence-transformers files)" if request.url.path == "/v1/embeddings" else "")
    return APIError(404, f"pagoda does not serve {request.method} {request.url.path[:200]}; it serves {served}{hint}",
                    code="endpoint_not_served")


def _validation_error(exc: RequestValidationError) -> APIError:
    return validation_error_of(exc.errors())


# ---- running it ------------------------------------------------------------------------------

def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory, or a hub name ORG/NAME (ORG/NAME:QUANT for one GGUF "
                             "file of it) fetched into the local cache (default: the built-in demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: MODEL as given, or pagoda-demo)")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY", os.environ.get("VLLM_API_KEY")),
                        help="require 'Authorization: Bearer KEY' on the API (default: $PAGODA_API_KEY, "
                             "else vLLM's $VLLM_API_KEY)")
    admission.add_cors_args(parser)
    parser.add_argument("--chat-template", default=None,
                        help="a chat template (a Jinja file, or the template itself) used instead of the "
                             "tokenizer's for every chat request, as vLLM's flag")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may take to finish on SIGINT/SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic log line of throughput, queue lengths and cache use")
    parser.add_argument("--max-queued-requests", type=_non_negative_int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests that may wait beyond the --max-num-seqs the engine runs at once; more "
                             "are refused with 429 and Retry-After (one per prompt of a request)")
    parser.add_argument("--max-request-body-size", type=_parse_size, default=DEFAULT_MAX_REQUEST_BODY_SIZE,
                        help="bytes; larger request bodies are refused with 413 before they are parsed")
    parser.add_argument("--request-body-timeout", type=_positive_float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        help="seconds a client has to send a request body once its headers are in; a slower "
                             "one gets 408 and the connection is closed")
    parser.add_argument("--auth-failure-delay", type=_non_negative_float, default=DEFAULT_AUTH_FAILURE_DELAY_S,
                        help="seconds a 401 for a wrong or missing API key waits, with its body unread, once its "
                             "client address has had more than a burst of them (20, refilled at 10 a second); "
                             "such a 401 carries Retry-After (0: answer every 401 at once)")
    parser.add_argument("--request-header-timeout", type=_positive_float, default=DEFAULT_REQUEST_HEADER_TIMEOUT_S,
                        help="seconds a connection has to send complete request headers (from when it opens, or "
                             "from the first byte of its next request); a slower one gets 408 and is closed")
    parser.add_argument("--max-request-header-size", type=_parse_size, default=DEFAULT_MAX_REQUEST_HEADER_SIZE,
                        help="bytes of request line and headers; more get 431 and the connection is closed")
    parser.add_argument("--max-connections", type=_non_negative_int, default=DEFAULT_MAX_CONNECTIONS,
                        help="open connections the server holds; a request on one beyond them gets 503 and its "
                             "connection is closed (0: no cap)")
    parser.add_argument("--max-connections-per-client", type=_non_negative_int,
                        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                        help="open connections one client address may hold; beyond them, as --max-connections "
                             "(0: no cap)")
    parser.add_argument("--engine-stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                        help="seconds without one turn of the engine loop after which /health reports the engine "
                             "as wedged (503); a long step is not a stall until it lasts this long")
    parser.add_argument("--metrics-compat", action="append", default=[], choices=METRICS_COMPAT_CHOICES,
                        help="also expose the queue and KV-cache gauges under this engine's metric names "
                             "(vllm:num_requests_waiting, ...) for autoscalers and routers that read them")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", default="auto", choices=[*sorted(TOOL_PARSERS), "auto", "none"],
                        help="how to find the tool calls a model writes, for tool_choice \"auto\"; auto (the "
                             "default) picks it from the chat template and turns tool_choice \"auto\" on when the "
                             "template shows a known call format; none keeps it off")
    parser.add_argument("--strict-tool-arguments", action=argparse.BooleanOptionalAction, default=True,
                        help="forced tool calls (tool_choice \"required\" or named) refuse argument keys the "
                             "function's schema does not declare when it lists properties without "
                             "additionalProperties (xgrammar's strict mode); --no-strict-tool-arguments lets the "
                             "model add keys such schemas allow")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split a reasoning model's <think>...</think> from its answer: chat replies carry it "
                             "in reasoning_content, and structured output applies after it")
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="refuse a request field pagoda does not know with 400 (default: ignore it and log a "
                             "warning naming it)")
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="send an OpenTelemetry span per request (queue, prefill, decode, response; GenAI "
                             "attributes) to this OTLP collector, e.g. http://127.0.0.1:4317; a client's traceparent "
                             "header continues its trace; sampling: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG "
                             "(needs pagoda[tracing])")
    parser.add_argument("--otlp-traces-protocol", default=None, choices=PROTOCOLS,
                        help="OTLP transport of --otlp-traces-endpoint (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "
                             f"else {DEFAULT_PROTOCOL}); with http/protobuf an address without a path gets /v1/traces")
    add_models_args(parser)
    add_lora_args(parser)
    add_tenant_args(parser)
    add_responses_args(parser)
    add_batch_args(parser)
    EngineArgs.add_cli_args(parser, skip=("model",))
    from pagoda.entrypoints.ray.args import add_ray_args  # no Ray import: the flags only

    add_ray_args(parser)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def serve_parser(raise_errors: bool = False) -> argparse.ArgumentParser:
    """A parser of ``pagoda serve``'s flags alone; with ``raise_errors`` a bad flag is a
    ``ValueError`` instead of an exit (Ray Serve's application builder)."""
    parser = (_RaisingParser if raise_errors else argparse.ArgumentParser)(prog="pagoda serve")
    add_serve_args(parser)
    return parser


def prepare_serve(args: argparse.Namespace) -> int | None:
    """What every ``pagoda serve`` does before the CLI chooses the server (this one or Ray Serve
    replicas): logging, refusing an empty API key, and the multi-node flags (a worker node
    serves no API: it runs its ranks here). Returns an exit code to stop with, or None."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_key == "":
        print(f"pagoda serve: error: {EMPTY_API_KEY_ERROR}", file=sys.stderr)
        return 1
    try:
        fold_single_model(args)  # one --model is the single server; several go to models_server
        if getattr(args, "chat_template", None):
            args.chat_template = read_chat_template(args.chat_template)  # a bad path fails before the model loads
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "node_rank", 0) > 0 or getattr(args, "nnodes", 1) > 1:
        from pagoda.entrypoints.worker_node import check_multinode_args

        return check_multinode_args(args)
    return None


def run_server(args: argparse.Namespace) -> int:
    """The single API server of ``pagoda serve`` (after ``prepare_serve``): returns the process
    exit code (non-zero if the engine failed)."""
    from pagoda.entrypoints.ray.args import check_single_server_args  # the flags only, no Ray import

    try:
        check_single_server_args(args)
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 1
    try:
        import uvloop  # a cheaper event loop per streamed chunk; optional
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


async def serve(args: argparse.Namespace) -> int:
    try:
        lora_modules = check_lora_args(args)
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 1
    try:
        # Take the port before the model loads: a port in use fails at once, not minutes later.
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"pagoda serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "enable_auto_tool_choice", False) and getattr(args, "tool_call_parser", None) == "none":
        print("pagoda serve: error: --enable-auto-tool-choice needs --tool-call-parser "
              f"({', '.join(sorted(TOOL_PARSERS))} or auto)", file=sys.stderr)
        return 1
    with sock:
        engine = await _start_engine(args)
        if engine is None:
            return 1
        # This process holds the engine until it exits: its start-up objects leave the collector's
        # full scans, each a pause of every stream (gc_freeze.py).
        if gc_freeze.freeze(collect_first=True):
            logger.info("%d start-up objects frozen out of the garbage collector's full scans (%s=0 keeps them in)",
                        gc_freeze.frozen_count(), gc_freeze.ENV)
        try:
            return await _serve_http(args, engine, sock, lora_modules)
        finally:
            await engine.shutdown()


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's template, or the template itself (vLLM's two forms);
    ``ValueError`` for a path that does not exist and is no template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in value:  # a Jinja template given inline
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a template")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _start_engine(args: argparse.Namespace) -> AsyncEngine | None:
    """Build the front end and start the engine core; None (after saying why) on failure.
    SIGINT/SIGTERM while the model loads cancel the start-up cleanly."""
    engine_args = EngineArgs.from_namespace(args)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
    engine: AsyncEngine | None = None
    # The engine core's imports and model load take seconds (more on a loaded machine): say so.
    where = f" (listening on {args.host}:{args.port} once it is ready)" if hasattr(args, "port") else ""
    logger.info("starting the engine core for %s%s", engine_args.model or "the built-in demo model", where)
    if getattr(args, "host", None) in ("127.0.0.1", "localhost", "::1"):
        logger.info("only this machine can connect; --host 0.0.0.0 accepts others (vLLM's default: a container's "
                    "port needs it)")
    try:
        engine = AsyncEngine(engine_args, args.log_level, max_queued_requests=args.max_queued_requests,
                             stall_timeout=args.engine_stall_timeout)
        ready = await engine.start()
    except Exception as exc:  # EngineStartupError, or a config the front end already refuses
        expected = isinstance(exc, (EngineStartupError, ValueError, OSError))
        message = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        print(f"pagoda serve: error: {message}", file=sys.stderr)
        return await _discard(engine)
    except asyncio.CancelledError:
        print("pagoda serve: interrupted during start-up", file=sys.stderr)
        return await _discard(engine)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    logger.info("engine core ready (pid %d): %d KV blocks of %d tokens, max_model_len %d",
                ready.pid, ready.num_blocks, ready.block_size, ready.max_model_len)
    return engine


def _enable_tracing(args: argparse.Namespace, engine: AsyncEngine, model_name: str) -> bool:
    """Trace requests to ``--otlp-traces-endpoint``; False (after saying why) if that cannot be."""
    try:
        from pagoda.engine.tracing import RequestTracer

        tracer = RequestTracer(args.otlp_traces_endpoint, model_name, args.otlp_traces_protocol)
    except ImportError as exc:
        print(f"pagoda serve: error: --otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporters "
              f"(pip install 'pagoda[tracing]'): {exc}", file=sys.stderr)
        return False
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return False
    engine.enable_tracing(tracer)
    logger.info("tracing requests to %s (OTLP %s)", args.otlp_traces_endpoint, tracer.protocol)
    return True


async def _discard(engine: AsyncEngine | None) -> None:
    if engine is not None:
        await engine.shutdown()
    return None


def api_server_options(args: argparse.Namespace, engine: AsyncEngine) -> dict[str, Any]:
    """``APIServer``'s keyword options from the serve flags, the same for the single server and
    every Ray replica: the reasoning and tool-call parsers (``ValueError`` naming a bad one), the
    field policy, tenants, stored responses and tool-argument strictness. ``--chat-template``
    (its text: ``prepare_serve`` read the file) is installed on the engine's tokenizers first (the
    parsers read the template)."""
    template = getattr(args, "chat_template", None)
    if template:
        engine.set_chat_template(template)
        logger.info("chat template from --chat-template (%d characters)", len(engine.tokenizer.chat_template))
    tool_call_parser = resolve_tool_parser(getattr(args, "tool_call_parser", None),
                                           getattr(args, "enable_auto_tool_choice", False),
                                           getattr(engine.tokenizer, "chat_template", None))
    if tool_call_parser is not None:
        logger.info("tool_choice \"auto\" reads calls with the %s parser", tool_call_parser)
    reasoning_name = getattr(args, "reasoning_parser", None)
    if not reasoning_name and tool_call_parser in TOOL_FORMAT_REASONING:
        # Harmony's calls and answer are only readable once its channels are split.
        reasoning_name = TOOL_FORMAT_REASONING[tool_call_parser]
        logger.info("the %s tool-call format needs its channels split: --reasoning-parser %s",
                    tool_call_parser, reasoning_name)
    needed = TOOL_FORMAT_REASONING.get(tool_call_parser or "")
    if needed is not None and reasoning_name != needed:
        raise ValueError(f"--tool-call-parser {tool_call_parser} reads calls from the --reasoning-parser {needed} "
                         f"split; --reasoning-parser {reasoning_name} cannot hand them on")
    reasoning = get_reasoning_parser(reasoning_name, engine.tokenizer) if reasoning_name else None
    return dict(log_stats=not args.disable_log_stats, metrics_compat=args.metrics_compat,
                tool_call_parser=tool_call_parser, reasoning_parser=reasoning,
                strict_request_fields=getattr(args, "strict_request_fields", False), tenants=tenant_policy(args),
                max_stored_responses=getattr(args, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES),
                strict_tool_arguments=getattr(args, "strict_tool_arguments", True))


async def _serve_http(args: argparse.Namespace, engine: AsyncEngine, sock: socket.socket,
                      lora_modules: list[tuple[str, str, str | None]] = ()) -> int:
    model_name = args.served_model_name or args.model or DEMO_MODEL_NAME
    try:
        options = api_server_options(args, engine)
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 1
    api = APIServer(engine, model_name, args.api_key,
                    allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False), **options)
    if getattr(args, "otlp_traces_endpoint", None) and not _enable_tracing(args, engine, model_name):
        return 1
    for name, path, base_model_name in lora_modules:
        try:
            await api.loras.load(name, path, base_model_name)  # type: ignore[union-attr]
        except APIError as exc:
            print(f"pagoda serve: error: --lora-modules {name}: {exc.message}", file=sys.stderr)
            return 1
    try:
        api.batches = build_batch_service(args, engine, api.completions.tenants, api.embeddings is not None)
    except (StorageInUseError, OSError) as exc:
        print(f"pagoda serve: error: --batch-storage-dir: {exc}", file=sys.stderr)
        return 1
    app = build_app(api)
    embeddings = {"/v1/embeddings": EmbeddingRequest} if api.embeddings is not None else {}
    checker = BodyChecker({**CHECKED_BODIES, **embeddings})
    admission.install(app, args.max_request_body_size, api.metrics.on_http_error, api_key=args.api_key,
                      request_body_timeout=args.request_body_timeout, checker=checker,
                      path_limits={"/v1/files": upload_body_limit(api.batches)},
                      auth_failure_delay=args.auth_failure_delay)
    admission.install_cors(app, args)
    limits = ConnectionLimits(args.request_header_timeout, args.max_request_header_size, args.max_connections,
                              args.max_connections_per_client)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=protocol_factory(limits, api.metrics.on_http_error),  # type: ignore[arg-type]
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    failed: list[str] = []

    def on_engine_dead(reason: str) -> None:
        failed.append(reason)
        asyncio.get_running_loop().call_later(DEATH_EXIT_DELAY_S, setattr, server, "should_exit", True)

    engine.on_dead(on_engine_dead)
    stat_task = asyncio.create_task(api.stat_logger.run()) if api.stat_logger is not None else None
    await api.batches.start()  # resumes the batches a previous server left unfinished
    try:
        with _absorb_resent_signals():
            await server.serve(sockets=[sock])
    finally:
        await api.batches.close()
        await api.chat.images.aclose()
        checker.close()
        if stat_task is not None:
            stat_task.cancel()
    if failed:
        print(f"pagoda serve: exiting because {failed[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


@contextlib.contextmanager
def _absorb_resent_signals() -> Iterator[None]:
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown so that the default
    handler kills the process; pagoda still has the engine core to stop, so catch them."""
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
