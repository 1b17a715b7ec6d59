"""LoRA adapters in the API server: the served names, the ``--lora-modules`` /
``--allow-runtime-lora-updating`` flags and vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` routes.

A request selects an adapter by its ``model`` name; ``/v1/models`` lists every adapter with
the base model as ``parent`` (and its name as ``root``: no server path is shown); an unknown
name is a 404 that lists nothing. Adapter names map to ``LoRARequest``s
with ids this server hands out (never reused, so an adapter unloaded and loaded again from
another path never shares prefix-cache KV with its old self).

Runtime updates (off unless ``--allow-runtime-lora-updating``): loading checks the adapter in
the front end (config) and in the engine (weights) before its name is served. Unloading stops
serving the name at once (new requests get 404); requests already running with the adapter
finish with it, and the engine drops its weights when the last of them leaves.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagoda.engine.async_engine import EngineDeadError
from pagoda.entrypoints.openai.protocol import ModelCard, RequestModel
from pagoda.entrypoints.openai.serving_common import APIError, FieldPolicy, engine_unavailable, error_responses
from pagoda.lora.peft import read_adapter_config
from pagoda.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagoda.engine.async_engine import AsyncEngine


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve from the start (needs --enable-lora): name=path, or JSON "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; requests select one by "
                             "its name as 'model'")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)")


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` entries as (name, path, base_model_name); ``ValueError`` if malformed."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                data = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"--lora-modules entry {value!r} is not valid JSON: {exc}") from exc
            unknown = set(data) - {"name", "path", "base_model_name"} if isinstance(data, dict) else set()
            if not isinstance(data, dict) or unknown or not isinstance(data.get("name"), str) \
                    or not isinstance(data.get("path"), str):
                raise ValueError(f"--lora-modules JSON entry {value!r} needs string 'name' and 'path' (and "
                                 f"optionally 'base_model_name'), nothing else")
            modules.append((data["name"], data["path"], data.get("base_model_name")))
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules entry {value!r} must be name=path")
            modules.append((name, path, None))
    names = [m[0] for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be unique, got {names}")
    return modules


def check_lora_args(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """The start-up checks of the LoRA flags, before the engine starts (``ValueError``)."""
    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if (modules or getattr(args, "allow_runtime_lora_updating", False)) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    for _, path, _ in modules:
        read_adapter_config(path, args.max_lora_rank)
    return modules


class LoRARegistry:
    """Served adapter names -> ``LoRARequest``s."""

    def __init__(self, engine: "AsyncEngine", base_model_name: str, allow_updates: bool) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.allow_updates = allow_updates
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}  # name -> the base model name /v1/models shows
        self._ids = itertools.count(1)
        self._loading: set[str] = set()
        self._lock = asyncio.Lock()

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 if unknown."""
        if not name or name == self.base_model_name:
            return None
        lora = self.adapters.get(name)
        if lora is None:  # other clients' adapter names are not listed (GET /v1/models shows them)
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=name, parent=self.parents.get(name, self.base_model_name),
                          max_model_len=max_model_len) for name, lora in self.adapters.items()]

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and load an adapter, then serve it as ``name``; ``APIError`` 400 if it cannot be."""
        if not name or not path:
            raise APIError(400, "lora_name and lora_path must not be empty", param="lora_name")
        if name == self.base_model_name or name in self.adapters or name in self._loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self._loading.add(name)
        try:
            try:  # file reads and a regex from the file: off the event loop
                await asyncio.to_thread(read_adapter_config, path,
                                        self.engine.config.lora.max_lora_rank)  # type: ignore[union-attr]
            except ValueError as exc:
                raise APIError(400, str(exc), param="lora_path") from exc
            lora = LoRARequest(name, next(self._ids), path)
            try:
                await self.engine.call_utility("add_lora", timeout=120.0,
                                               args=[lora.lora_name, lora.lora_int_id, lora.lora_path])
            except (EngineDeadError, asyncio.TimeoutError) as exc:
                raise engine_unavailable(exc) from exc
            except RuntimeError as exc:  # the engine refused the weights: its message says why
                raise APIError(400, str(exc).removeprefix("ValueError: "), param="lora_path") from exc
            self.adapters[name] = lora
            self.parents[name] = base_model_name or self.base_model_name
            return lora
        finally:
            self._loading.discard(name)

    async def unload(self, name: str) -> None:
        lora = self.adapters.pop(name, None)
        self.parents.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        try:
            await self.engine.call_utility("remove_lora", args=[lora.lora_int_id])
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            raise engine_unavailable(exc) from exc


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


def lora_routes(registry: LoRARegistry, auth: tuple[int, ...], fields: FieldPolicy | None = None) -> APIRouter:
    router = APIRouter()
    fields = fields or FieldPolicy()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                 responses=error_responses(400, *auth, 500, 503))
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Any:
        fields.check(req)
        await registry.load(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                 responses=error_responses(400, *auth, 404, 500, 503))
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Any:
        fields.check(req)
        await registry.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
