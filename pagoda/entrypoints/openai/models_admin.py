"""The operator routes of a several-models server, each naming its model or acting on all:

- sleep mode (``--enable-sleep-mode``, per model or for all): ``/sleep``, ``/wake_up``,
  ``/is_sleeping``, ``/reset_prefix_cache``, ``/update_weights``, with an optional ``model``
  (query parameter or JSON body); without it they apply to every loaded model with sleep mode,
  as one server's do to its model;
- runtime LoRA adapters (``--allow-runtime-lora-updating``): ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` with ``base_model_name`` naming the base model (optional when only
  one model loads adapters at run time); an adapter loaded so is loaded again with its model
  after an unload;
- the dashboard: ``/dashboard`` (one page, a model selector) and ``/dashboard/api/state?model=``
  (a loaded model's snapshot, every model's state).

They act on a model through ``ModelRegistry.hold_loaded`` (a 409 when it is not loaded; counted
in flight meanwhile, so no load unloads it under the call).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

import pagoda
from pagoda.engine.async_engine import EngineDeadError
from pagoda.entrypoints.openai.dashboard import STATE_PATH
from pagoda.entrypoints.openai.dashboard.routes import page_routes
from pagoda.entrypoints.openai.models_router import ModelRegistry, ModelSlot
from pagoda.entrypoints.openai.protocol import ErrorResponse, RequestModel
from pagoda.entrypoints.openai.server import sleep_call
from pagoda.entrypoints.openai.serving_common import APIError, FieldPolicy, engine_unavailable, error_responses
from pagoda.entrypoints.openai.serving_lora import parse_lora_modules


# The 409 of a call on a model that is not loaded (or is being loaded or unloaded).
_NOT_LOADED = {409: {"model": ErrorResponse, "description": "The model is not loaded, or is being loaded"}}


# ---- sleep mode -------------------------------------------------------------------------------

class RoutedUpdateWeightsRequest(RequestModel):
    """``POST /update_weights`` of a several-models server: the checkpoint, and which model
    (default: every loaded model with sleep mode)."""

    model_path: str = Field(min_length=1, max_length=4096)
    model: str | None = Field(default=None, min_length=1, max_length=4096)


def sleeps(slot: ModelSlot) -> bool:
    """Whether ``slot``'s model runs with sleep mode."""
    return bool(getattr(slot.spec.args, "enable_sleep_mode", False))


async def _body_model(request: Request, query: str | None) -> str | None:
    """The ``model`` of a query parameter, else of a JSON object body (an empty body: none)."""
    if query is not None:
        return query
    body = await request.body()
    if not body.strip():
        return None
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object (with an optional 'model')")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    return model


@contextlib.asynccontextmanager
async def _targets(registry: ModelRegistry, name: str | None):  # type: ignore[no-untyped-def]
    """The slots a sleep-mode call acts on, held: the named one (400 without sleep mode, 409 not
    loaded), or every loaded one with sleep mode."""
    async with contextlib.AsyncExitStack() as stack:
        if name is not None:
            slot = registry.lookup(name)
            if not sleeps(slot):
                raise APIError(400, f"the model {slot.name!r} runs without sleep mode (enable_sleep_mode)",
                               param="model")
            yield [await stack.enter_async_context(registry.hold_loaded(slot.name))]
            return
        names = [s.name for s in registry.slots.values() if sleeps(s) and s.usable()]
        yield [await stack.enter_async_context(registry.hold_loaded(n)) for n in names]


def sleep_routes(registry: ModelRegistry, auth: tuple[int, ...], fields: FieldPolicy) -> APIRouter:
    """The sleep-mode routes over several models (see the module's docstring)."""
    router = APIRouter()
    errors = {**error_responses(400, *auth, 404, 500, 503), **_NOT_LOADED}

    async def each(slots: list[ModelSlot], method: str, args: list | None = None) -> dict[str, Any]:
        results = await asyncio.gather(*(sleep_call(s.loaded.engine, method, args)  # type: ignore[union-attr]
                                         for s in slots))
        return dict(zip([s.name for s in slots], results))

    @router.post("/sleep", responses=errors)
    async def sleep(request: Request, level: int = 1, model: str | None = None) -> dict[str, Any]:
        """Put one model (``model``) or every loaded one to sleep: level 1 drops the KV cache, 2
        the weights too; its requests wait until /wake_up. A sleeping model is not unloaded to
        make room for another."""
        name = await _body_model(request, model)
        async with _targets(registry, name) as slots:
            released = await each(slots, "sleep", [level])
            for slot in slots:
                slot.sleeping = level
        if name is not None:
            return {"model": slots[0].name, "level": level, "released_bytes": released[slots[0].name]}
        return {"level": level, "released_bytes": sum(released.values()),
                "models": {n: {"level": level, "released_bytes": b} for n, b in released.items()}}

    @router.post("/wake_up", responses=errors)
    async def wake_up(request: Request, model: str | None = None) -> dict[str, Any]:
        name = await _body_model(request, model)
        async with _targets(registry, name) as slots:
            await each(slots, "wake_up")
            for slot in slots:
                slot.sleeping = 0
        return {"is_sleeping": False, **({"model": slots[0].name} if name is not None else
                                         {"models": [s.name for s in slots]})}

    @router.get("/is_sleeping", responses=errors)
    async def is_sleeping(model: str | None = None) -> dict[str, Any]:
        """One model's sleep level (a model not loaded is awake), or every loaded model's with
        ``is_sleeping`` true when all of them sleep."""
        if model is not None and not registry.lookup(model).usable():
            return {"model": registry.lookup(model).name, "is_sleeping": False, "level": 0}
        async with _targets(registry, model) as slots:
            levels = await each(slots, "is_sleeping")
        for slot in slots:
            slot.sleeping = levels[slot.name]
        if model is not None:
            level = levels[slots[0].name]
            return {"model": slots[0].name, "is_sleeping": bool(level), "level": level}
        return {"is_sleeping": bool(levels) and all(levels.values()),
                "models": {n: {"is_sleeping": bool(v), "level": v} for n, v in levels.items()}}

    @router.post("/reset_prefix_cache", responses=errors)
    async def reset_prefix_cache(request: Request, model: str | None = None) -> dict[str, Any]:
        name = await _body_model(request, model)
        async with _targets(registry, name) as slots:
            evicted = await each(slots, "reset_prefix_cache")
        if name is not None:
            return {"model": slots[0].name, "evicted_blocks": evicted[slots[0].name]}
        return {"evicted_blocks": sum(evicted.values()), "models": evicted}

    @router.post("/update_weights", responses=errors)
    async def update_weights(req: RoutedUpdateWeightsRequest) -> dict[str, Any]:
        """Serve another checkpoint (same architecture and shapes) on one model, or on every
        loaded one in turn (a refusal stops there, naming the models already updated). A model
        unloaded later loads this checkpoint again."""
        fields.check(req)
        done: list[str] = []
        async with _targets(registry, req.model) as slots:
            for slot in slots:
                try:
                    await sleep_call(slot.loaded.engine, "update_weights", [req.model_path])  # type: ignore[union-attr]
                except APIError as exc:
                    exc.message = f"model {slot.name!r}: {exc.message}" + \
                        (f" (already updated: {', '.join(done)})" if done else "")
                    raise
                slot.weights_path = req.model_path
                done.append(slot.name)
        return {"model_path": req.model_path, **({"model": done[0]} if req.model is not None else {"models": done})}

    return router


# ---- runtime LoRA adapters --------------------------------------------------------------------

class RoutedLoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter`` of a several-models server: vLLM's fields, and the base model."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = Field(default=None, min_length=1)


class RoutedUnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides
    base_model_name: str | None = Field(default=None, min_length=1)


def updates_loras(slot: ModelSlot) -> bool:
    """Whether ``slot``'s model loads LoRA adapters at run time."""
    ns = slot.spec.args
    return bool(getattr(ns, "enable_lora", False) and getattr(ns, "allow_runtime_lora_updating", False))


def lora_base(registry: ModelRegistry, base_model_name: str | None) -> ModelSlot:
    """The model an adapter is loaded onto: the one named (404 unknown, 400 when it does not load
    adapters at run time), else the only one that does (400 when several or none do)."""
    updatable = [s for s in registry.slots.values() if updates_loras(s)]
    if base_model_name is not None:
        slot = registry.slots.get(base_model_name)
        if slot is None:
            raise APIError(404, f"the model {base_model_name!r} does not exist; this server serves "
                           f"{registry.names()}", param="base_model_name", code="model_not_found")
        if slot not in updatable:
            raise APIError(400, f"the model {slot.name!r} does not load LoRA adapters at run time (it needs "
                           "enable_lora and allow_runtime_lora_updating)", param="base_model_name")
        return slot
    if len(updatable) != 1:
        which = ", ".join(repr(s.name) for s in updatable) or "none"
        raise APIError(400, f"name the adapter's base model in 'base_model_name' (models loading LoRA adapters at "
                       f"run time: {which})", param="base_model_name")
    return updatable[0]


def lora_routes(registry: ModelRegistry, auth: tuple[int, ...], fields: FieldPolicy) -> APIRouter:
    """vLLM's adapter routes over several models (see the module's docstring)."""
    router = APIRouter()
    loading: set[str] = set()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                 responses=error_responses(400, *auth, 404, 500, 503))
    async def load_lora_adapter(req: RoutedLoadLoRAAdapterRequest) -> Any:
        """Load an adapter onto its base model (loading the model first if it is not loaded)."""
        fields.check(req)
        base = lora_base(registry, req.base_model_name)
        name = req.lora_name
        if name in registry.slots or registry.adapter_base(name) is not None or name in loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        loading.add(name)
        try:
            slot = await registry.acquire(base.name)
            try:
                await slot.loaded.api.loras.load(name, req.lora_path)  # type: ignore[union-attr]
                # Recorded while the model is still held: a reload from now on brings the adapter.
                slot.runtime_loras[name] = req.lora_path
                registry.add_adapter(name, slot)
            finally:
                await registry.release(slot)
        finally:
            loading.discard(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                 responses={**error_responses(400, *auth, 404, 500, 503), **_NOT_LOADED})
    async def unload_lora_adapter(req: RoutedUnloadLoRAAdapterRequest) -> Any:
        """Stop serving an adapter loaded at run time (new requests get 404; running ones finish)."""
        fields.check(req)
        name = req.lora_name
        slot = registry.adapter_base(name)
        if slot is None or (req.base_model_name is not None and req.base_model_name != slot.name):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        if name not in slot.runtime_loras:
            raise APIError(400, f"the LoRA adapter {name!r} is configured in the lora_modules of {slot.name!r} "
                           "and is loaded with it each time; it cannot be unloaded at run time", param="lora_name")
        if slot.status not in ("loaded", "loadable"):
            raise APIError(409, f"the model {slot.name!r} is {slot.status}; retry later", code="model_busy")
        if slot.usable():
            async with registry.hold_loaded(slot.name):
                await slot.loaded.api.loras.unload(name)  # type: ignore[union-attr]
        slot.runtime_loras.pop(name, None)
        registry.drop_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router


async def load_adapters(slot: ModelSlot, api: Any) -> list[str]:
    """Load ``slot``'s adapters into its freshly started ``api``: its ``lora_modules`` (a failure
    raises ``ValueError``: the load fails) and those loaded at run time (one that no longer loads
    is dropped, logged, and returned, so the model still loads)."""
    import logging

    for name, path, base in parse_lora_modules(getattr(slot.spec.args, "lora_modules", None)):
        try:
            await api.loras.load(name, path, base)
        except APIError as exc:
            raise ValueError(f"LoRA adapter {name}: {exc.message}") from exc
    dropped = []
    for name, path in list(slot.runtime_loras.items()):
        try:
            await api.loras.load(name, path, slot.name)
        except APIError as exc:
            logging.getLogger("pagoda.models").warning("model %r: the LoRA adapter %r loaded at run time no longer "
                                                       "loads (%s); it is dropped", slot.name, name, exc.message)
            slot.runtime_loras.pop(name, None)
            slot.adapters.discard(name)
            dropped.append(name)
    return dropped


# ---- the dashboard ------------------------------------------------------------------------------

def models_overview(registry: ModelRegistry) -> list[dict[str, Any]]:
    """Every model's line on the dashboard: status, requests in flight, loads, sleep level."""
    return [{"name": s.name, "status": s.status, "in_flight": s.in_flight, "loads": s.loads,
             "sleeping": s.sleeping, "footprint_bytes": s.spec.footprint, "last_error": s.last_error,
             "engine_pid": s.loaded.engine.engine_pid if s.loaded is not None else None,
             "adapters": sorted(s.adapters)} for s in registry.slots.values()]


def dashboard_routes(registry: ModelRegistry, auth: Sequence[Any], auth_codes: tuple[int, ...]
                     ) -> tuple[APIRouter, APIRouter]:
    """The page (open) and the snapshot (behind ``auth``) of a several-models server."""
    api = APIRouter(dependencies=list(auth))

    @api.get(STATE_PATH, responses=error_responses(*auth_codes, 404, 500, 503))
    async def state(model: str | None = None) -> dict[str, Any]:
        """``model``'s snapshot (a served name or an adapter's; default: the first loaded model)
        with ``models``: every model's state. A model that is not loaded has ``engine`` null;
        viewing never loads a model nor counts as its use."""
        if model is not None:
            slot = registry.lookup(model)
        else:
            slot = next((s for s in registry.slots.values() if s.usable()), next(iter(registry.slots.values())))
        doc = await _model_state(slot)
        doc["models"] = models_overview(registry)
        return doc

    return page_routes(), api


async def _model_state(slot: ModelSlot) -> dict[str, Any]:
    loaded = slot.loaded
    if slot.usable() and loaded is not None and loaded.api is not None:
        try:
            doc = await loaded.api.dashboard.state()
            doc["server"]["status"] = slot.status
            return doc
        except (asyncio.TimeoutError, EngineDeadError) as exc:
            if slot.usable():
                raise engine_unavailable(exc) from exc
    # Not loaded (or unloaded while asked): the model's name and status, no engine.
    return {"time": time.time(), "engine": None,
            "server": {"model": slot.name, "version": pagoda.__version__, "status": slot.status}}
