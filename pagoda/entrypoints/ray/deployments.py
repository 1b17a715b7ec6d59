"""The two Ray Serve deployments of a scaled-out pagoda.

``EngineReplica`` is a whole pagoda server without its socket: an ``AsyncEngine`` (with its
engine-core process) and pagoda's own FastAPI app (``build_app``: validation, chat templates,
streaming, logprobs, errors, API key, metrics). It runs HTTP requests handed to it by calling
that app in-process (``asgi_frames``) and streams back the response: a start frame
``(status, headers, replica id)``, then body chunks.

``Ingress`` is the endpoint (Serve's HTTP proxy in front of it). The single server's
``RequestGuard`` stands in front of its routes (``IngressGuard``): the API key is checked from
the headers before the body is read (with the same wrong-key penalty), the body is read within
``--request-body-timeout`` and ``--max-request-body-size``, and a large body (1 MiB or more) for a
generation or tokenize route is validated in a sandboxed worker process first
(``body_check.py``). It then reads the request, computes the prompt's prefix hashes for the router
(not for a large body, whose decoding would hold the event loop), sends the request to a replica through a
deployment handle whose request router is ``PagodaRequestRouter``, and relays the answer.
A replica that is gone (its actor died) or answers 503 (its engine died) before anything was
sent to the client gets the request retried on another replica; a stream that was already
running ends with an error event. ``/health`` and ``/metrics`` ask every replica.
"""
# No ``from __future__ import annotations`` here: Serve's ingress wrapper reads the route
# handlers' annotations at run time (a string ``Request`` would become a query parameter).
import argparse
import asyncio
import json
import logging
import os
import secrets
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from pagoda.engine import gc_freeze
from pagoda.entrypoints.openai import admission
from pagoda.entrypoints.openai.body_check import LARGE_BODY_BYTES, BodyChecker
from pagoda.entrypoints.openai.serving_common import SSE_DONE, APIError, sse_error
from pagoda.entrypoints.ray.metrics_merge import merge_metrics
from pagoda.entrypoints.ray.routing import request_prefix_hashes

logger = logging.getLogger("pagoda.ray")

# Attempts per request (the first and the retries on other replicas).
MAX_ATTEMPTS = 3
# Statuses after which a request that produced nothing yet goes to another replica: the
# replica's engine is gone (503) or that replica is at capacity (429).
RETRY_STATUSES = (429, 503)
# Seconds a fan-out call (/health, /metrics) waits for one replica.
FAN_OUT_TIMEOUT_S = 5.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


# ---- running an ASGI app in-process ---------------------------------------------------------

async def asgi_frames(app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes, batch_interval_s: float = 0.0) -> AsyncIterator[Any]:
    """Call the ASGI ``app`` with one HTTP request; yield ``(status, headers)`` and then the
    body chunks (bytes). Closing the iterator early is the client going away: the app sees
    ``http.disconnect`` (pagoda then aborts the request in the engine).

    Body chunks that are already waiting go out as one. With ``batch_interval_s`` > 0, a chunk
    that follows another by less than that interval waits for the rest of it, and whatever came
    meanwhile goes out with it (a stream's tokens in a few frames instead of one each: every
    frame costs a message through Ray). The first body chunk and the last one never wait."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    arrived = asyncio.Event()  # set by every message: the batching wait below watches it

    async def send(message: dict[str, Any]) -> None:
        messages.put_nowait(message)
        arrived.set()

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            messages.put_nowait(None)
            arrived.set()

    chunks: list[bytes] = []  # the body frame being gathered

    def take_waiting() -> bool | None:
        """Append the next waiting body chunk to ``chunks``; its ``more_body``, or None when
        the next message is the app's end (left in the queue)."""
        following = messages.get_nowait()
        if following is None or following["type"] != "http.response.body":
            messages.put_nowait(following)
            return None
        chunks.append(bytes(following.get("body", b"")))
        return following.get("more_body", False)

    task = asyncio.create_task(run())
    loop = asyncio.get_running_loop()
    last_sent: float | None = None  # when the last body frame went out
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield (message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                           for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                chunks = [bytes(message.get("body", b""))]
                more = message.get("more_body", False)
                if more and last_sent is not None and batch_interval_s > 0:
                    deadline = last_sent + batch_interval_s
                    while more and (left := deadline - loop.time()) > 0:
                        if messages.empty():
                            # Wait on the event, not on the queue: a get that times out just as a
                            # message comes could lose that message (wait_for on Python < 3.12).
                            arrived.clear()
                            try:
                                await asyncio.wait_for(arrived.wait(), left)
                            except asyncio.TimeoutError:
                                break
                            continue
                        if (taken := take_waiting()) is None:
                            break  # the app ended: send what we have
                        more = taken
                # Coalesce what is already waiting (a stream's events pile up while the
                # reader is slow): one frame through Ray instead of one per event.
                while more and not messages.empty():
                    if (taken := take_waiting()) is None:
                        break
                    more = taken
                data = b"".join(chunks)
                if data:
                    last_sent = loop.time()
                    yield data
                if not more:
                    break
        await task
    finally:
        if not task.done():
            gone.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except BaseException:  # noqa: BLE001 - the app's own errors were logged by it
                task.cancel()


# ---- the engine replica ----------------------------------------------------------------------

class EngineReplica:
    """One pagoda server as a Ray Serve replica (see the module docstring)."""

    async def __init__(self, args: argparse.Namespace) -> None:
        """``args``: ``pagoda serve``'s parsed flags."""
        # Set first: Serve calls ``__del__`` on a replica whose start failed, and an attribute
        # missing there hid the real error behind an AttributeError.
        self.engine: Any = None
        self._stat_task: asyncio.Task | None = None
        cwd = getattr(args, "replica_cwd", None)
        if cwd and os.path.isdir(cwd):  # relative paths in the flags mean the user's folder
            os.chdir(cwd)
        from pagoda.config import EngineArgs
        from pagoda.engine.async_engine import AsyncEngine
        from pagoda.entrypoints.openai import admission
        from pagoda.entrypoints.openai.server import DEMO_MODEL_NAME, APIServer, api_server_options, build_app

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.stream_batching_interval_s = args.stream_batching_interval_ms / 1e3
        if args.pin_replicas_to_cpus:
            rank = int(getattr(context.rank, "rank", context.rank))
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[rank % len(cores)]})  # the engine-core process inherits it
            logger.info("replica %s (rank %d) pinned to CPU %d", self.replica_id, rank, cores[rank % len(cores)])
        self.engine = AsyncEngine(EngineArgs.from_namespace(args), args.log_level,
                                  max_queued_requests=args.max_queued_requests,
                                  stall_timeout=args.engine_stall_timeout)
        ready = await self.engine.start()
        model_name = args.served_model_name or args.model or DEMO_MODEL_NAME
        # The same options as the single server: parsers, field policy, tenants, stored responses.
        self.api = APIServer(self.engine, model_name, args.api_key, **api_server_options(args, self.engine))
        if getattr(args, "otlp_traces_endpoint", None):  # each replica exports its own requests' spans
            from pagoda.engine.tracing import RequestTracer

            self.engine.enable_tracing(RequestTracer(args.otlp_traces_endpoint, model_name,
                                                     getattr(args, "otlp_traces_protocol", None)))
        from pagoda.entrypoints.openai.serving_lora import check_lora_args

        for name, path, parent in check_lora_args(args):  # every replica serves the same adapters
            await self.api.loras.load(name, path, parent)  # type: ignore[union-attr]
        self.app = build_app(self.api)
        admission.install(self.app, args.max_request_body_size, self.api.metrics.on_http_error)
        self._stat_task = (asyncio.create_task(self.api.stat_logger.run())
                           if self.api.stat_logger is not None else None)
        logger.info("replica %s: engine core ready (pid %d): %d KV blocks of %d tokens", self.replica_id,
                    ready.pid, ready.num_blocks, ready.block_size)

    async def serve_http(self, call: dict[str, Any], routing: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        """Run one HTTP request (``call``: method, path, query, headers, body) through the
        replica's pagoda app: yields ``(status, headers, replica id, first body chunk)``, then
        the other body chunks. The start travels with the first chunk (one message through Ray
        fewer per request); a stream's later chunks are batched by ``--stream-batching-interval-ms``."""
        frames = asgi_frames(self.app, call["method"], call["path"], call.get("query", ""), call["headers"],
                             call["body"], self.stream_batching_interval_s)
        start: tuple[int, list[tuple[str, str]]] | None = None
        try:
            async for frame in frames:
                if isinstance(frame, tuple):
                    start = frame
                elif start is not None:
                    yield (start[0], start[1], self.replica_id, frame)
                    start = None
                else:
                    yield frame
            if start is not None:  # a response without a body
                yield (start[0], start[1], self.replica_id, b"")
        finally:
            await frames.aclose()

    async def info(self, routing: dict[str, Any] | None = None) -> dict[str, Any]:
        """This replica's health and prefix-cache counters (the ingress's /health)."""
        try:
            self.engine.check_health()
            healthy, reason = True, None
        except Exception as exc:  # EngineDeadError: reported, not raised, so /health can say which
            healthy, reason = False, str(exc)
        stats = self.engine.last_stats
        return {"replica": self.replica_id, "healthy": healthy, "reason": reason, "engine_pid": self.engine.engine_pid,
                "prefix_cache_queries": stats.prefix_cache_queries if stats else 0,
                "prefix_cache_hits": stats.prefix_cache_hits if stats else 0,
                "num_running": stats.num_running if stats else 0, "num_waiting": stats.num_waiting if stats else 0,
                # Serve froze the actor's start-up heap after __init__ (RAY_SERVE_FREEZE_GC_ON_STARTUP),
                # as the single server's front end freezes its own (gc_freeze.py)
                "gc_frozen": gc_freeze.frozen_count()}

    async def metrics(self, routing: dict[str, Any] | None = None) -> tuple[str, str]:
        body, content_type = self.api.metrics.render()
        return self.replica_id, body.decode() if isinstance(body, bytes) else body

    def check_health(self) -> None:
        """Serve's health check: a dead or wedged engine makes Serve replace this replica."""
        self.engine.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.engine.last_stats
        return {"num_waiting": stats.num_waiting if stats else 0, "num_running": stats.num_running if stats else 0}

    async def __del__(self) -> None:
        if self._stat_task is not None:
            self._stat_task.cancel()
        if self.engine is not None:  # None: the start failed before the engine existed
            await self.engine.shutdown()


async def _relay_stream(stream: Any, first: bytes) -> AsyncIterator[bytes]:
    """A replica's SSE stream (``first``: the chunk that came with its start); if the replica
    dies mid-stream, an error event and the end of the stream (the client never waits on a
    replica that is gone)."""
    finished = False
    try:
        if first:
            yield first
        async for chunk in stream:
            yield chunk
        finished = True
    except Exception as exc:  # noqa: BLE001 - whatever broke, the client gets an end, not a hang
        finished = True
        if isinstance(exc, (RayActorError, ActorUnavailableError)):
            logger.warning("replica failed mid-stream: %s", exc)
            error = APIError(503, "the replica serving this stream failed; the stream was ended",
                             code="engine_unavailable")
        else:
            logger.exception("relaying a stream failed")
            error = APIError(500, "internal server error", code="internal_error")
        yield sse_error(error).encode()
        yield SSE_DONE.encode()
    finally:
        if not finished:  # the client went away: the replica stops the request in its engine
            stream.cancel()


def _pass_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in headers if k.lower() not in ("content-length", "transfer-encoding", "connection")}


# ---- the ingress -----------------------------------------------------------------------------

class IngressGuard:
    """The single server's ``admission.RequestGuard`` in front of the ingress app's routes. The
    app's middleware is fixed when this module is imported, the guard's options (key, limits)
    only when the ``Ingress`` replica starts: ``configure`` sets them for this process, and the
    guard is built at the first request. Unconfigured, requests pass unguarded."""

    options: dict[str, Any] | None = None

    def __init__(self, app: Any) -> None:
        self.app = app
        self.guard: Any = None
        self.built_from: dict[str, Any] | None = None

    @classmethod
    def configure(cls, api_key: str | None, max_bytes: int,
                  body_timeout_s: float = admission.DEFAULT_REQUEST_BODY_TIMEOUT_S,
                  auth_failure_delay: float = admission.DEFAULT_AUTH_FAILURE_DELAY_S,
                  checker: BodyChecker | None = None) -> None:
        cls.options = dict(api_key=api_key, max_bytes=max_bytes, body_timeout_s=body_timeout_s,
                           auth_failure_delay=auth_failure_delay, checker=checker, on_refused=lambda status: None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        options = IngressGuard.options
        if options is None:
            await self.app(scope, receive, send)
            return
        if self.guard is None or self.built_from is not options:
            self.guard, self.built_from = admission.RequestGuard(self.app, **options), options
        await self.guard(scope, receive, send)


ingress_app = FastAPI(title="pagoda", docs_url=None, redoc_url=None, openapi_url=None)
ingress_app.add_middleware(IngressGuard)


@serve.ingress(ingress_app)
class Ingress:
    """The endpoint: relays requests to engine replicas (see the module docstring)."""

    def __init__(self, engine: Any, engine_deployment: str, max_request_body_size: int,
                 api_key: str | None = None,
                 request_body_timeout: float = admission.DEFAULT_REQUEST_BODY_TIMEOUT_S,
                 auth_failure_delay: float = admission.DEFAULT_AUTH_FAILURE_DELAY_S) -> None:
        from pagoda.entrypoints.openai.server import CHECKED_BODIES

        self.engine = engine
        self.api_key = api_key
        self.checker = BodyChecker(CHECKED_BODIES)  # its worker starts at the first large body
        IngressGuard.configure(api_key, max_request_body_size, request_body_timeout, auth_failure_delay,
                               self.checker)
        self._stream_handle: Any = None
        self.engine_deployment = engine_deployment
        self.max_request_body_size = max_request_body_size

    def __del__(self) -> None:
        self.checker.close()

    async def _streaming(self) -> Any:
        """The streaming handle, made from ``self.engine`` once its router exists, so both
        share one router (one view of the replicas and of their requests in flight)."""
        if self._stream_handle is None:
            await self._broadcast("info")  # initializes self.engine's router
            self._stream_handle = self.engine.options(stream=True)
        return self._stream_handle

    @ingress_app.get("/health")
    async def health(self) -> Response:
        infos = await self._broadcast("info")
        healthy = [i for i in infos if isinstance(i, dict) and i.get("healthy")]
        if not healthy:
            reasons = "; ".join(f"{i.get('replica')}: {i.get('reason')}" for i in infos if isinstance(i, dict))
            return APIError(503, f"no healthy replica ({reasons or 'no replica is running'})",
                            code="engine_unavailable").response()
        return JSONResponse({"status": "ok", "replicas": sorted(infos, key=lambda i: i["replica"])})

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        pages = [p for p in await self._broadcast("metrics") if isinstance(p, tuple)]
        return Response(merge_metrics(sorted(pages)), media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.get("/debug/router")
    async def router_stats(self, request: Request) -> Response:
        if self.api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                code="invalid_api_key").response()
        router = await self._router()
        return JSONResponse(router.stats() if router else {})

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def forward(self, request: Request, path: str) -> Response:
        body = await self._read_body(request)
        if body is None:
            return APIError(413, f"the request body is larger than {self.max_request_body_size} bytes").response()
        url_path = request.url.path
        hashes: list[str] = []
        if request.method == "POST" and url_path in GENERATION_PATHS and len(body) < LARGE_BODY_BYTES:
            try:
                hashes = request_prefix_hashes(url_path, json.loads(body))
            except ValueError:
                pass  # not JSON: the replica answers the 400
        call = {"method": request.method, "path": url_path, "query": request.url.query,
                "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                "body": body}
        return await self._relay(call, hashes)

    # ---- relaying ----------------------------------------------------------------------------
    async def _relay(self, call: dict[str, Any], hashes: list[str]) -> Response:
        avoid: list[str] = []
        last: Response | None = None
        for attempt in range(MAX_ATTEMPTS):
            stream = (await self._streaming()).serve_http.remote(call, routing={"hashes": hashes, "avoid": avoid})
            try:
                status, headers, replica, first = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as exc:
                logger.warning("replica failed before answering (attempt %d): %s", attempt + 1, exc)
                last = APIError(503, "the replica serving this request failed", code="engine_unavailable").response()
                continue
            except StopAsyncIteration:
                last = APIError(500, "internal server error", code="internal_error").response()
                break
            content_type = dict((k.lower(), v) for k, v in headers).get("content-type", "")
            if content_type.startswith("text/event-stream") and status == 200:
                return StreamingResponse(_relay_stream(stream, first), status_code=status,
                                         headers=_pass_headers(headers))
            try:
                data = first + b"".join([chunk async for chunk in stream])
            except (RayActorError, ActorUnavailableError) as exc:
                logger.warning("replica %s failed while answering (attempt %d): %s", replica, attempt + 1, exc)
                avoid.append(replica)
                last = APIError(503, "the replica serving this request failed", code="engine_unavailable").response()
                continue
            last = Response(data, status_code=status, headers=_pass_headers(headers))
            if status not in RETRY_STATUSES:
                return last
            avoid.append(replica)
            if status == 503:
                router = await self._router()
                if router is not None:
                    router.mark_suspect(replica)
            logger.warning("replica %s answered %d; retrying elsewhere (attempt %d)", replica, status, attempt + 1)
        assert last is not None
        return last

    async def _read_body(self, request: Request) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_body_size:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    # ---- fan-out ----------------------------------------------------------------------------
    async def _router(self) -> Any:
        from pagoda.entrypoints.ray.router import find_router  # at call time (see registry.py)

        return find_router(self.engine_deployment)

    async def _broadcast(self, method: str) -> list[Any]:
        """``method`` on every running replica; a replica that fails or times out gives an
        ``info``-shaped report of why (for /health), or is left out (for /metrics)."""
        try:
            answers = await self.engine.broadcast(method, routing={}).results_async(
                timeout_s=FAN_OUT_TIMEOUT_S, return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - no replica, or the whole call timed out
            logger.warning("%s: no answer from the replicas: %s: %s", method, type(exc).__name__, exc)
            return []
        out: list[Any] = []
        for answer in answers:
            if isinstance(answer, BaseException):
                logger.warning("a replica did not answer %s: %s: %s", method, type(answer).__name__, answer)
                if method == "info":
                    out.append({"replica": "?", "healthy": False, "reason": f"{type(answer).__name__}: {answer}"})
            else:
                out.append(answer)
        return out
