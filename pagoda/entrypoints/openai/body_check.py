"""Large request bodies are decoded and validated first in a worker process, so that an invalid
one is refused without costing the event loop anything.

Why a process: ``json.loads`` and pydantic's validation hold the GIL from start to end, so in a
worker thread a 21 MiB body of token ids stalls the loop as long as on it (0.2-0.9 s measured).
A body the worker finds valid is parsed again by the route as usual: a valid body is bounded by
the model's limits (prompt tokens, prompts per call, messages), an invalid one is not. The
worker answers with the same 400 the route would give (``validation_error_of``). The worker is a
``pagoda.sandbox.Sandbox``: a body that crashes it, runs past its time or memory is refused.
"""
from __future__ import annotations

import asyncio
import importlib
import json
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from pagoda.entrypoints.openai.serving_common import APIError, validation_error_of
from pagoda.sandbox import Sandbox, SandboxBusy, SandboxError

# Bodies at least this large are checked in the worker first; smaller ones cost the loop little.
LARGE_BODY_BYTES = 1 << 20
# A worker's limits: decoding a body at the size limit (32 MiB) into Python objects and
# validating it takes well under both.
CHECK_TIMEOUT_S = 30.0
CHECK_MEMORY_MIB = 2048


class BodyChecker:
    """Checks large JSON bodies of the routes in ``models`` (path -> request model) in one
    sandboxed worker process, started at the first such body."""

    def __init__(self, models: Mapping[str, type[BaseModel]], min_bytes: int = LARGE_BODY_BYTES) -> None:
        self.models = {path: f"{m.__module__}:{m.__qualname__}" for path, m in models.items()}
        self.min_bytes = min_bytes
        self._sandbox = Sandbox(_import_models, (tuple(self.models.values()),), workers=1,
                                timeout=CHECK_TIMEOUT_S, memory_mib=CHECK_MEMORY_MIB)

    def wants(self, method: str, path: str, content_type: str, size: int) -> bool:
        """Whether to check this body first: a large one the route would decode as JSON."""
        media = content_type.split(";", 1)[0].strip().lower()
        is_json = media in ("", "application/json") or (media.startswith("application/") and media.endswith("+json"))
        return method == "POST" and size >= self.min_bytes and path in self.models and is_json

    async def check(self, path: str, body: bytes) -> APIError | None:
        """The 400 for an invalid body (a 503 while the worker stays busy with other bodies
        past the check's timeout), or None when the route may parse it."""
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                None, self._sandbox.call, check_body, self.models[path], body)
        except SandboxBusy:
            return APIError(503, "the server is busy checking other large request bodies; retry later",
                            code="server_overloaded")
        except SandboxError:  # the body took the worker down (memory, time): refuse it
            return APIError(400, "the request body could not be parsed within the server's limits")
        return None if found is None else APIError(400, found[0], param=found[1])

    def close(self) -> None:
        self._sandbox.shutdown()


def _import_models(names: tuple[str, ...]) -> None:
    """The worker's start-up: import the request models' modules once, before any body."""
    for name in names:
        importlib.import_module(name.partition(":")[0])


def check_body(state: Any, model_name: str, body: bytes) -> tuple[str, str | None] | None:
    """In the worker: None if ``body`` is a valid ``model_name`` ("module:Class"), else the
    (message, param) of the route's 400 (``state``: the sandbox's, unused)."""
    module, _, name = model_name.partition(":")
    model: type[BaseModel] = getattr(importlib.import_module(module), name)
    try:
        model.model_validate(json.loads(body))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, ValidationError
        if isinstance(exc, ValidationError):
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False, include_context=False)]
        else:
            errors = [{"type": "json_invalid", "loc": ("body",), "ctx": {"error": getattr(exc, "msg", str(exc))}}]
        error = validation_error_of(errors)
        return error.message, error.param
    return None
