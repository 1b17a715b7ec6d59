"""``pagoda serve`` with several models (``--model`` more than once, ``--models-config``).

One HTTP server; each model runs in its own engine-core process behind its own
``AsyncEngine`` and the same app a single-model server builds (``LoadedModel``, started by
``start_model``). ``ModelDispatch`` sends each request whose body names a ``model`` to its
model's app, loading it first when needed (``ModelRegistry``). The server's own routes answer
for all models: ``/v1/models`` (each with its ``status``), ``/health`` (up while the server is),
``/debug/models`` (per-model state), ``/metrics`` (every model's series, ``model_name`` label),
the stored responses (one store for every model) and the Files and Batch API (its lines routed
like any request, ``models_batch``). A model's engine dying fails only its own requests; it
loads again at its next request.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import sys
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Iterable, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import Field
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric

import pagoda
from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.anthropic.routes import wrap_outermost
from pagoda.entrypoints.openai import admission
from pagoda.entrypoints.openai.admission import INVALID_KEY_MESSAGE, add_overload_handler, key_matches
from pagoda.entrypoints.openai.batch.routes import batch_routes, upload_body_limit
from pagoda.entrypoints.openai.batch.storage import StorageInUseError
from pagoda.entrypoints.openai.body_check import BodyChecker
from pagoda.entrypoints.openai.models_admin import dashboard_routes as admin_dashboard_routes
from pagoda.entrypoints.openai.models_admin import load_adapters, lora_routes, sleep_routes, sleeps, updates_loras
from pagoda.entrypoints.openai.models_batch import RoutedBatchService, build_routed_batch_service
from pagoda.entrypoints.openai.models_config import model_specs
from pagoda.entrypoints.openai.models_router import ROUTED_PATHS, LoadedModel, ModelDispatch, ModelRegistry, ModelSlot
from pagoda.entrypoints.openai.protocol import ErrorResponse, ModelCard, OpenAIModel, RequestModel
from pagoda.entrypoints.openai.server import (CHECKED_BODIES, APIServer, _absorb_resent_signals,
                                              _add_error_handlers, _bind, _enable_tracing, api_server_options,
                                              build_app)
from pagoda.entrypoints.openai.serving_common import APIError, FieldPolicy, error_responses, finish_openapi
from pagoda.entrypoints.openai.serving_embedding import EmbeddingRequest
from pagoda.entrypoints.openai.serving_lora import check_lora_args
from pagoda.entrypoints.openai.tenants import tenant_policy
from pagoda.entrypoints.openai.serving_responses import (DEFAULT_MAX_STORED_RESPONSES, ResponsesServing,
                                                         ResponseStore, responses_routes)

logger = logging.getLogger("pagoda.server")

ModelStatus = Literal["loaded", "loading", "loadable", "unloading"]


class RoutedModelCard(ModelCard):
    """A model card of a several-models server: ``status`` says whether the model is loaded,
    being loaded (or unloaded), or loadable on demand."""

    status: ModelStatus


class RoutedModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[RoutedModelCard]


class ModelAction(RequestModel):
    """``POST /models/load`` and ``/models/unload``: which model."""

    model: str = Field(min_length=1, max_length=4096)


_BUSY = {"model": ErrorResponse, "description": "The model has requests in flight, or is loading"}


# ---- metrics ----------------------------------------------------------------------------------

class FrontMetrics:
    """The server's own series: refusals no model is known for (``model_name`` ""), and per
    model whether it is loaded and how often it was loaded. ``render`` adds every model's
    ``ServerMetrics``, families merged, so a scrape sees one family per metric name."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.models = registry
        self.registry = CollectorRegistry()
        self.http_errors = Counter("pagoda:request_errors", "Requests refused or failed, by HTTP status.",
                                   ["model_name", "status"], registry=self.registry)
        self.loaded = Gauge("pagoda:model_loaded", "1 while the model is loaded (several models).", ["model_name"],
                            registry=self.registry)
        self.loads = Gauge("pagoda:model_loads", "Times the model was loaded since start (several models).",
                           ["model_name"], registry=self.registry)

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels("", str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        for slot in self.models.slots.values():
            self.loaded.labels(slot.name).set(1 if slot.loaded is not None else 0)
            self.loads.labels(slot.name).set(slot.loads)
        registries = [self.registry, *(s.metrics.registry for s in self.models.slots.values() if s.metrics)]
        merged = CollectorRegistry()
        merged.register(_Merged(registries))
        return generate_latest(merged), CONTENT_TYPE_LATEST


class _Merged:
    """A collector yielding the families of several registries, those of one name as one."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for metric in registry.collect():
                family = families.get(metric.name)
                if family is None:
                    family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type)
                family.samples.extend(metric.samples)
        return families.values()


# ---- one model's server ---------------------------------------------------------------------

async def start_model(args: argparse.Namespace, store: ResponseStore, slot: ModelSlot) -> LoadedModel:
    """Start ``slot``'s engine core and build its app as the single server builds one (its
    parsers, LoRA adapters, tracing); its stored responses go to the shared ``store``. Raises
    (after stopping what it started) if any of that fails."""
    ns = slot.spec.args
    if slot.weights_path is not None:  # its last /update_weights: the checkpoint it serves now
        ns = copy.copy(ns)
        ns.model, ns.tokenizer = slot.weights_path, ns.tokenizer or ns.model
    # Built in a worker thread: it loads two tokenizers (the first load in a process also imports
    # their libraries, seconds), which would hold up every other model's requests on the loop.
    # Nothing in it touches the loop: its ZMQ sockets attach to the loop at their first use.
    engine = await asyncio.to_thread(AsyncEngine, EngineArgs.from_namespace(ns), args.log_level,
                                     max_queued_requests=ns.max_queued_requests,
                                     stall_timeout=ns.engine_stall_timeout, name=slot.name)
    stat_task: asyncio.Task | None = None
    try:
        await engine.start()
        api = APIServer(engine, slot.name, args.api_key, metrics=slot.metrics, **api_server_options(ns, engine))
        slot.metrics = api.metrics
        if getattr(args, "otlp_traces_endpoint", None) and not _enable_tracing(args, engine, slot.name):
            raise ValueError("tracing could not be set up (see the server log)")
        if api.loras is not None:
            await load_adapters(slot, api)
        api.responses.store = store
        app = build_app(api)
        add_overload_handler(app, api.metrics.on_http_error)
        if api.stat_logger is not None:
            stat_task = asyncio.create_task(api.stat_logger.run())
    except BaseException:
        await engine.shutdown()
        raise

    async def close() -> None:
        if stat_task is not None:
            stat_task.cancel()
        await engine.shutdown()

    return LoadedModel(engine, app, close, api)


# ---- the server's own routes ------------------------------------------------------------------

def build_front_app(args: argparse.Namespace, registry: ModelRegistry, store: ResponseStore,
                    metrics: FrontMetrics, batches: RoutedBatchService) -> FastAPI:
    """The app clients reach: the routes answering for all models (the Files and Batch API's
    too, whose lines run through this app), with ``ModelDispatch`` in front of them for the
    per-model routes, behind the key and body guard."""
    app = FastAPI(title="pagoda", version=pagoda.__version__, docs_url=None, redoc_url=None)
    _add_error_handlers(app, SimpleNamespace(metrics=metrics))  # type: ignore[arg-type]
    auth = (401,) if args.api_key else ()

    async def check_key(request: Request) -> None:
        if args.api_key is not None and not key_matches(request.headers.get("authorization", ""), args.api_key,
                                                        request.headers.get("x-api-key")):
            raise APIError(401, INVALID_KEY_MESSAGE, code="invalid_api_key")

    app.include_router(_public_routes(registry, metrics))
    app.include_router(_model_routes(registry, auth), dependencies=[Depends(check_key)])
    stored = ResponsesServing(None, 0)  # type: ignore[arg-type]  # reads the store only: creation is routed
    stored.store = store
    app.include_router(responses_routes(stored, auth), dependencies=[Depends(check_key)])
    fields = FieldPolicy(getattr(args, "strict_request_fields", False))
    app.include_router(batch_routes(batches, auth, fields), dependencies=[Depends(check_key)])
    batches.attach(app)
    slots = list(registry.slots.values())
    if any(sleeps(s) for s in slots):
        app.include_router(sleep_routes(registry, auth, fields), dependencies=[Depends(check_key)])
    if any(updates_loras(s) for s in slots):
        app.include_router(lora_routes(registry, auth, fields), dependencies=[Depends(check_key)])
    page, state = admin_dashboard_routes(registry, [Depends(check_key)], auth)
    app.include_router(page)
    app.include_router(state)
    _merge_openapi(app, registry, getattr(args, "strict_request_fields", False))
    app.add_middleware(ModelDispatch, registry=registry, on_error=metrics.on_http_error)
    checker = BodyChecker({**CHECKED_BODIES, "/v1/embeddings": EmbeddingRequest})
    app.state.checker = checker
    admission.install(app, args.max_request_body_size, metrics.on_http_error, api_key=args.api_key,
                      request_body_timeout=args.request_body_timeout, checker=checker,
                      path_limits={"/v1/files": upload_body_limit(batches)},
                      auth_failure_delay=args.auth_failure_delay)
    admission.install_cors(app, args)
    wrap_outermost(app)  # errors on /v1/messages in Anthropic's shape, the dispatcher's included
    return app


def _public_routes(registry: ModelRegistry, metrics: FrontMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health", responses=error_responses(500))
    @router.get("/ping", responses=error_responses(500))
    async def health() -> Response:
        """Up while the server is: a model's engine dying fails only that model's requests
        (``/debug/models`` has each model's state)."""
        return JSONResponse({"status": "ok", "models": {s.name: s.status for s in registry.slots.values()}})

    @router.post("/ping", responses=error_responses(500))
    async def ping_post() -> Response:  # (its own route: one operation id per method)
        """The same answer as /health, to a POST."""
        return await health()

    @router.get("/version", responses=error_responses(500))
    async def version() -> dict[str, Any]:
        return {"version": pagoda.__version__}

    @router.get("/metrics", response_class=PlainTextResponse,
                responses={200: {"description": "Prometheus text format"}, **error_responses(500)})
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router


def _model_routes(registry: ModelRegistry, auth: tuple[int, ...]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models", responses=error_responses(*auth, 500))
    async def models() -> RoutedModelList:
        return RoutedModelList(data=[card for slot in registry.slots.values() for card in _cards(slot)])

    @router.get("/v1/models/{model_id:path}", responses=error_responses(*auth, 404, 500))
    async def model(model_id: str) -> RoutedModelCard:
        card = next((c for c in (await models()).data if c.id == model_id), None)
        if card is None:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return card

    @router.post("/models/load", responses=error_responses(400, *auth, 404, 500, 503))
    async def load(req: ModelAction) -> RoutedModelCard:
        """Load a model now (as its first request would), unloading idle ones to make room."""
        await registry.release(await registry.acquire(req.model))
        return _cards(registry.lookup(req.model))[0]

    @router.post("/models/unload", responses={**error_responses(400, *auth, 404, 500), 409: _BUSY})
    async def unload(req: ModelAction) -> RoutedModelCard:
        """Unload an idle model (a 409 while it has requests in flight); its next request loads it."""
        return _cards(await registry.unload_idle(req.model))[0]

    @router.get("/debug/models", responses=error_responses(*auth, 500))
    async def debug_models() -> dict[str, Any]:
        """Per model: status, engine-core pid, footprint estimate, requests in flight, loads,
        last error; and the limits."""
        return {"models": registry.describe(), "max_loaded_models": registry.max_loaded,
                "models_memory_budget": registry.memory_budget}

    return router


def _cards(slot: ModelSlot) -> list[RoutedModelCard]:
    """The model's card and its LoRA adapters' (those of the running engine once loaded)."""
    status, max_len = slot.status, slot.spec.max_model_len
    api = slot.loaded.api if slot.loaded is not None else None
    if api is not None and api.loras is not None:
        adapters = [(c.id, c.parent) for c in api.loras.cards(api.engine.max_model_len)]
    else:
        adapters = [(name, slot.name) for name in sorted(slot.adapters)]
    return [RoutedModelCard(id=slot.name, root=slot.name, max_model_len=max_len, status=status),
            *(RoutedModelCard(id=name, root=name, parent=parent, max_model_len=max_len, status=status)
              for name, parent in adapters)]


def _merge_openapi(app: FastAPI, registry: ModelRegistry, strict_fields: bool) -> None:
    """The API document: the server's own routes, and the per-model routes as a loaded model's
    app documents them."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        schema = finish_openapi(default(), strict_fields)
        for slot in registry.slots.values():
            if slot.loaded is not None:
                model_doc = slot.loaded.app.openapi()  # type: ignore[attr-defined]
                for path, item in model_doc.get("paths", {}).items():
                    if path in ROUTED_PATHS:
                        schema["paths"].setdefault(path, item)
                components = schema.setdefault("components", {}).setdefault("schemas", {})
                for name, body in model_doc.get("components", {}).get("schemas", {}).items():
                    components.setdefault(name, body)
                break
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- running it -------------------------------------------------------------------------------

def check_models_args(args: argparse.Namespace,
                      start: Callable[[ModelSlot], Awaitable[LoadedModel]]) -> ModelRegistry:
    """The models and their registry (which starts a model with ``start``) from the flags;
    ``ValueError`` naming what is wrong."""
    specs = model_specs(args)
    updating = [s for s in specs if getattr(s.args, "allow_runtime_lora_updating", False)]
    if updating and not any(getattr(s.args, "enable_lora", False) for s in updating):
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora (or enable_lora on a model)")
    adapters: dict[str, str] = {}
    for spec in specs:
        if not getattr(spec.args, "enable_lora", False):
            spec.args.allow_runtime_lora_updating = False  # the flag is for the models serving LoRA
        try:
            modules = check_lora_args(spec.args)
        except ValueError as exc:
            raise ValueError(f"model {spec.name!r}: {exc}") from exc
        for name, _, _ in modules:
            if name in adapters or any(name == s.name for s in specs):
                raise ValueError(f"the LoRA adapter name {name!r} of model {spec.name!r} is served twice")
            adapters[name] = spec.name
    registry = ModelRegistry(specs, start, args.max_loaded_models, args.models_memory_budget,
                             args.model_load_timeout, adapters)
    registry.check_budget()
    return registry


def run_models_server(args: argparse.Namespace) -> int:
    """``pagoda serve`` with several models (after ``prepare_serve``): the exit code."""
    try:
        import uvloop  # a cheaper event loop per streamed chunk; optional
    except ImportError:
        return asyncio.run(serve_models(args))
    return uvloop.run(serve_models(args))


async def serve_models(args: argparse.Namespace) -> int:
    store = ResponseStore(getattr(args, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES))
    try:
        registry = check_models_args(args, lambda slot: start_model(args, store, slot))
        sock = _bind(args.host, args.port)  # before any model loads: a port in use fails at once
    except (ValueError, OSError) as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 1
    metrics = FrontMetrics(registry)
    with sock:
        try:
            batches = build_routed_batch_service(args, registry, tenant_policy(args))
        except (StorageInUseError, OSError) as exc:
            print(f"pagoda serve: error: --batch-storage-dir: {exc}", file=sys.stderr)
            return 1
        app = build_front_app(args, registry, store, metrics, batches)
        try:
            for slot in [s for s in registry.slots.values() if s.spec.preload]:
                try:
                    await registry.load(slot.name)
                except Exception as exc:
                    print(f"pagoda serve: error: model {slot.name!r}: {exc}", file=sys.stderr)
                    return 1
            logger.info("serving %d models: %s", len(registry.slots), registry.names())
            await batches.start()  # resumes the batches a previous server left unfinished
            return await _serve_http(args, app, sock, metrics)
        finally:
            await batches.close()
            await registry.close()
            app.state.checker.close()


async def _serve_http(args: argparse.Namespace, app: FastAPI, sock: Any, metrics: FrontMetrics) -> int:
    from pagoda.entrypoints.openai.connections import ConnectionLimits, protocol_factory

    limits = ConnectionLimits(args.request_header_timeout, args.max_request_header_size, args.max_connections,
                              args.max_connections_per_client)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=protocol_factory(limits, metrics.on_http_error),  # type: ignore[arg-type]
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    with _absorb_resent_signals():
        await server.serve(sockets=[sock])
    return 0 if server.started else 1
