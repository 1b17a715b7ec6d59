"""Several models behind one server: the ``ModelRegistry`` (each model's engine core loaded on
demand within a budget, the least recently used idle one unloaded to make room, a crashed one
reloaded at its next request) and ``ModelDispatch`` (an ASGI layer that sends each request
whose body names a ``model`` to that model's own app).

Each loaded model is a whole single-model server in miniature (``LoadedModel``): its own
``AsyncEngine`` (and so its own engine-core process), its ``APIServer`` and the FastAPI app
``build_app`` makes of it. The registry knows nothing of HTTP beyond the ``APIError`` it raises;
how a model is started is the ``start`` function it is given (``models_server.start_model``).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.openai.models_config import ModelSpec
from pagoda.entrypoints.openai.serving_common import APIError

logger = logging.getLogger("pagoda.models")

LOADED, LOADING, LOADABLE, UNLOADING = "loaded", "loading", "loadable", "unloading"
# The routes whose JSON body names the model that serves them.
ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                          "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize"})
# Seconds a client whose model is still loading is told to wait before retrying.
LOADING_RETRY_AFTER_S = 5
# Seconds between two looks for an idle model to unload while a load waits for room.
ROOM_POLL_S = 0.5


@dataclass
class LoadedModel:
    """One model's running parts: its engine (``AsyncEngine``), the app serving it, and what
    must be stopped with it (``close``)."""

    engine: Any
    app: ASGIApp
    close: Callable[[], Awaitable[None]]
    api: Any = None  # its APIServer (the LoRA adapters, the model card's length)


@dataclass
class ModelSlot:
    """A served model and its state. ``in_flight`` counts requests routed to it whose response
    has not ended (those waiting for its load included); ``last_used`` orders the slots for LRU (a larger value: used later)."""

    spec: ModelSpec
    status: str = LOADABLE
    loaded: LoadedModel | None = None
    task: asyncio.Task | None = None  # the load in progress (or the last one, done)
    in_flight: int = 0
    last_used: int = 0
    loads: int = 0
    last_error: str | None = None
    metrics: Any = None  # its ServerMetrics, kept across loads so its counters carry on
    adapters: set[str] = field(default_factory=set)  # LoRA adapter names routed to it
    # Adapters loaded at run time (name -> path): loaded again with the model after an unload.
    runtime_loras: dict[str, str] = field(default_factory=dict)
    sleeping: int = 0  # the sleep level set through the server's /sleep (0: awake); never unloaded asleep
    weights_path: str | None = None  # the checkpoint of its last /update_weights: a reload serves it

    @property
    def name(self) -> str:
        return self.spec.name

    def usable(self) -> bool:
        """Loaded with a live engine."""
        return self.status == LOADED and self.loaded is not None and not self.loaded.engine.is_dead

    def busy(self) -> bool:
        """Requests routed here not ended, or engine requests still running (a background
        response outlives its HTTP request)."""
        engine = self.loaded.engine if self.loaded is not None else None
        return self.in_flight > 0 or (engine is not None and bool(engine.output_processor.requests))


class ModelRegistry:
    """The served models by name, loaded on demand.

    Invariants: at most ``max_loaded`` models are loaded and their footprints sum to at most
    ``memory_budget`` bytes (None: no limit); loads run one at a time, each first unloading
    least-recently-used idle models until the new one fits (waiting for one to become idle
    when none is); a busy model is never unloaded; a request for a model being loaded waits
    for it up to ``load_timeout`` seconds (then 503, the load going on)."""

    def __init__(self, specs: list[ModelSpec], start: Callable[[ModelSlot], Awaitable[LoadedModel]],
                 max_loaded: int | None = None, memory_budget: int | None = None,
                 load_timeout: float = 600.0, adapters: dict[str, str] | None = None) -> None:
        self.slots = {spec.name: ModelSlot(spec) for spec in specs}
        self.start = start
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.load_timeout = load_timeout
        self.adapters = dict(adapters or {})  # LoRA adapter name -> its base model's name
        for adapter, base in self.adapters.items():
            self.slots[base].adapters.add(adapter)
        self._clock = itertools.count(1)
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Condition()  # a request ended, or a model unloaded or died
        self._closing: set[asyncio.Task] = set()

    def check_budget(self) -> None:
        """``ValueError`` if a model could never be loaded under the limits, or the models to
        preload do not fit together."""
        for slot in self.slots.values():
            if self.memory_budget is not None and slot.spec.footprint > self.memory_budget:
                raise ValueError(f"model {slot.name!r} needs about {slot.spec.footprint} bytes (weights + KV "
                                 f"cache), more than --models-memory-budget {self.memory_budget}")
        preload = [s for s in self.slots.values() if s.spec.preload]
        if self.max_loaded is not None and len(preload) > self.max_loaded:
            raise ValueError(f"--preload names {len(preload)} models, more than --max-loaded-models {self.max_loaded}")
        total = sum(s.spec.footprint for s in preload)
        if self.memory_budget is not None and total > self.memory_budget:
            raise ValueError(f"the preloaded models need about {total} bytes together, more than "
                             f"--models-memory-budget {self.memory_budget}")

    # ---- lookup and use ------------------------------------------------------------------
    def lookup(self, name: Any) -> ModelSlot:
        """The slot of a request's ``model`` (a served name or a LoRA adapter of one); a 400
        when it is missing, a 404 when nothing here serves it."""
        if name is None or name == "":
            raise APIError(400, f"'model' is required: this server serves several models ({self.names()})",
                           param="model")
        if not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        slot = self.slots.get(name) or self.adapter_base(name)
        if slot is None:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.names()}",
                           param="model", code="model_not_found")
        return slot

    def adapter_base(self, name: str) -> ModelSlot | None:
        """The model serving the LoRA adapter ``name`` (None: no such adapter)."""
        slot = self.slots.get(self.adapters.get(name, ""))
        return slot if slot is not None and name in slot.adapters else None

    def add_adapter(self, name: str, slot: ModelSlot) -> None:
        """Route the adapter ``name`` to ``slot`` from now on."""
        self.adapters[name] = slot.name
        slot.adapters.add(name)

    def drop_adapter(self, name: str) -> None:
        """Stop routing the adapter ``name``."""
        slot = self.adapter_base(name)
        if slot is not None:
            slot.adapters.discard(name)
        self.adapters.pop(name, None)

    def names(self) -> str:
        return ", ".join(repr(n) for n in self.slots)

    async def acquire(self, name: Any) -> ModelSlot:
        """The slot of ``name``, loaded, counted in flight until ``release``; waits while it
        loads. 503 if the load fails or outlasts ``load_timeout`` (the load goes on). The
        request counts as in flight while it waits, so another load cannot unload the model
        between its load and its use."""
        slot = self.lookup(name)
        slot.in_flight += 1
        try:
            await self._wait_loaded(slot)
        except BaseException:
            await self.release(slot)
            raise
        slot.last_used = next(self._clock)
        return slot

    async def _wait_loaded(self, slot: ModelSlot) -> None:
        deadline = asyncio.get_running_loop().time() + self.load_timeout
        while not (slot.status == LOADED and not slot.loaded.engine.is_dead):  # type: ignore[union-attr]
            if slot.task is None or slot.task.done():
                slot.status = LOADING
                slot.task = asyncio.create_task(self._load(slot), name=f"pagoda-load-{slot.name}")
            task = slot.task
            try:
                await asyncio.wait_for(asyncio.shield(task), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                raise APIError(503, f"the model {slot.name!r} is still loading after {self.load_timeout:g} s "
                               "(--model-load-timeout); retry later", code="model_loading",
                               headers={"Retry-After": str(LOADING_RETRY_AFTER_S)}) from None
            except Exception as exc:
                raise APIError(503, f"the model {slot.name!r} failed to load: {exc}",
                               code="model_load_failed") from exc
            if slot.loaded is None or slot.loaded.engine.is_dead:  # it died as soon as it loaded
                raise APIError(503, f"the model {slot.name!r} is not available: {slot.last_error}",
                               code="engine_unavailable")

    @contextlib.asynccontextmanager
    async def hold_loaded(self, name: Any) -> AsyncIterator[ModelSlot]:
        """An operator's call on a loaded model (sleep, weights, adapters): the slot, counted in
        flight (so no load unloads it meanwhile) without loading it or counting as a use; a 409
        ``model_not_loaded`` when it is not loaded."""
        slot = self.lookup(name)
        if not slot.usable():
            raise APIError(409, f"the model {slot.name!r} is not loaded (it is {slot.status}); load it first with "
                           "POST /models/load", code="model_not_loaded")
        slot.in_flight += 1
        try:
            yield slot
        finally:
            slot.in_flight -= 1
            await self._notify()

    async def release(self, slot: ModelSlot) -> None:
        """A request ``acquire`` gave ``slot`` ended: a load waiting for room may go on."""
        slot.in_flight -= 1
        slot.last_used = next(self._clock)
        async with self._changed:
            self._changed.notify_all()

    # ---- loading and unloading ------------------------------------------------------------
    async def load(self, name: str) -> None:
        """Load ``name`` now (``--preload``); raises what its start raised."""
        slot = self.lookup(name)
        slot.status = LOADING
        slot.task = asyncio.create_task(self._load(slot))
        await slot.task

    async def unload_idle(self, name: Any) -> ModelSlot:
        """Unload ``name`` at an operator's request: a 409 if it has requests in flight or is
        loading; nothing to do if it is not loaded."""
        slot = self.lookup(name)
        if slot.status == LOADING or slot.busy():
            raise APIError(409, f"the model {slot.name!r} is {'loading' if slot.status == LOADING else 'busy'} "
                           f"({slot.in_flight} requests in flight); retry later", code="model_busy")
        await self.unload(slot)
        return slot

    async def _load(self, slot: ModelSlot) -> None:
        try:
            async with self._load_lock:
                if slot.loaded is not None and not slot.loaded.engine.is_dead:
                    slot.status = LOADED
                    return
                await self._discard(slot)
                await self._make_room(slot)
                logger.info("loading model %r (about %d bytes)", slot.name, slot.spec.footprint)
                slot.loaded = await self.start(slot)
                slot.loads += 1
                slot.last_used = next(self._clock)
                slot.status = LOADED
                slot.loaded.engine.on_dead(lambda reason: self._on_dead(slot, reason))
                logger.info("model %r loaded (engine core pid %s)", slot.name, slot.loaded.engine.engine_pid)
        except BaseException as exc:
            slot.status = LOADABLE
            slot.last_error = f"load failed: {exc}"
            logger.error("model %r failed to load: %s", slot.name, exc)
            raise

    def _fits(self, slot: ModelSlot) -> bool:
        others = [s for s in self.slots.values() if s is not slot and s.loaded is not None]
        if self.max_loaded is not None and len(others) + 1 > self.max_loaded:
            return False
        used = sum(s.spec.footprint for s in others)
        return self.memory_budget is None or used + slot.spec.footprint <= self.memory_budget

    def _idle_victim(self, slot: ModelSlot) -> ModelSlot | None:
        """The least recently used loaded model other than ``slot`` with nothing in flight and
        not asleep (unloading a sleeping model would turn its /wake_up into a full load)."""
        idle = [s for s in self.slots.values()
                if s is not slot and s.loaded is not None and s.status == LOADED and not s.busy() and not s.sleeping]
        return min(idle, key=lambda s: s.last_used, default=None)

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload idle models, least recently used first, until ``slot`` fits; while none is
        idle, wait for a request to end."""
        while not self._fits(slot):
            victim = self._idle_victim(slot)
            if victim is None:
                # Woken when a routed request ends; polled too, for engine requests that end on
                # their own (background responses).
                async with self._changed:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), ROOM_POLL_S)
                continue
            logger.info("unloading model %r (least recently used) to make room for %r", victim.name, slot.name)
            await self.unload(victim)

    async def unload(self, slot: ModelSlot) -> None:
        """Stop ``slot``'s engine (callers make sure it is idle)."""
        loaded, slot.loaded = slot.loaded, None
        if loaded is None:
            return
        slot.status, slot.sleeping = UNLOADING, 0
        try:
            await loaded.close()
        finally:
            slot.status = LOADABLE if slot.task is None or slot.task.done() else LOADING
            async with self._changed:
                self._changed.notify_all()

    async def _discard(self, slot: ModelSlot) -> None:
        """Close what is left of a dead engine before loading the model again."""
        if slot.loaded is not None:
            loaded, slot.loaded = slot.loaded, None
            await loaded.close()

    def _on_dead(self, slot: ModelSlot, reason: str) -> None:
        """The model's engine core died: its requests already failed (naming it); the others
        go on. It frees its place and loads again at its next request."""
        slot.last_error = reason
        if slot.loaded is None or not slot.loaded.engine.is_dead:
            return
        loaded, slot.loaded = slot.loaded, None
        slot.status, slot.sleeping = LOADABLE, 0
        task = asyncio.create_task(loaded.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        task.add_done_callback(lambda _: asyncio.ensure_future(self._notify()))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        """Stop every model (server shutdown)."""
        for slot in self.slots.values():
            if slot.task is not None and not slot.task.done():
                slot.task.cancel()
        # In parallel: each engine core takes a moment to stop.
        await asyncio.gather(*(self.unload(s) for s in self.slots.values() if s.loaded is not None),
                             *self._closing, return_exceptions=True)

    # ---- reports ----------------------------------------------------------------------------
    def describe(self) -> dict[str, dict[str, Any]]:
        """Per model: status, engine-core pid, footprint estimate, requests in flight, loads,
        last error (``/debug/models``)."""
        return {slot.name: {"status": slot.status, "model": slot.spec.args.model,
                            "engine_pid": slot.loaded.engine.engine_pid if slot.loaded is not None else None,
                            "footprint_bytes": slot.spec.footprint, "in_flight": slot.in_flight,
                            "loads": slot.loads, "last_used": slot.last_used, "last_error": slot.last_error,
                            "adapters": sorted(slot.adapters), "sleeping": slot.sleeping,
                            "weights_path": slot.weights_path}
                for slot in self.slots.values()}


class _ModelField(msgspec.Struct):
    """The one field the dispatcher reads of a body; the others are skipped unparsed."""

    model: Any = None


_MODEL_DECODER = msgspec.json.Decoder(_ModelField)


def model_of(body: bytes) -> Any:
    """The ``model`` of a JSON request body; a 400 if the body is not a JSON object."""
    try:
        return _MODEL_DECODER.decode(body).model
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not a valid JSON object: {exc}") from exc


class ModelDispatch:
    """ASGI: a POST to one of ``ROUTED_PATHS`` goes to the app of the model its body names
    (loaded first if need be), counted in flight until its response has ended, streaming
    included; everything else goes to ``app`` (the server's own routes)."""

    def __init__(self, app: ASGIApp, registry: ModelRegistry, on_error: Callable[[int], None]) -> None:
        self.app = app
        self.registry = registry
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTED_PATHS:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left
            return
        try:
            slot = await self.registry.acquire(model_of(body))
        except APIError as exc:
            self.on_error(exc.status)
            await exc.response()(scope, receive, send)
            return
        try:
            await slot.loaded.app(scope, _replay(body, receive), send)  # type: ignore[union-attr]
        finally:
            await self.registry.release(slot)


async def _read_body(receive: Receive) -> bytes | None:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body again, once, then the real ``receive`` (a stream learns of a disconnect there)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
