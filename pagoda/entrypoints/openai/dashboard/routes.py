"""The dashboard's routes and the JSON snapshot they serve.

``Dashboard.state()`` joins the engine core's ``EngineSnapshot`` (asked with the ``snapshot``
utility call, at most once per ``MIN_SNAPSHOT_INTERVAL_S`` however many viewers poll, so the
engine answers a few calls a second at most and none when nobody looks) with the front end's
``DashboardHistory``. Prefix previews are decoded here, and only for prefixes that are not
salted, and never when the server isolates tenants' caches (then every prefix shows as its hash
and length).
"""
from __future__ import annotations

import asyncio
import time
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import msgspec
from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

import pagoda
from pagoda.engine.async_engine import AsyncEngine, EngineDeadError
from pagoda.engine.snapshot import EngineSnapshot
from pagoda.entrypoints.openai.dashboard import DASHBOARD_PATH, STATE_PATH, STATIC_PREFIX
from pagoda.entrypoints.openai.dashboard.history import DashboardHistory
from pagoda.entrypoints.openai.serving_common import APIError, engine_unavailable, error_responses

# Viewers polling at once share one engine snapshot this fresh.
MIN_SNAPSHOT_INTERVAL_S = 0.5
SNAPSHOT_TIMEOUT_S = 10.0
STATIC_DIR = Path(str(resources.files("pagoda.entrypoints.openai.dashboard") / "static"))
_CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".png": "image/png",
                  ".svg": "image/svg+xml"}


class Dashboard:
    """What the dashboard routes share: the engine, the history and whether text may be shown."""

    def __init__(self, engine: AsyncEngine, model_name: str, history: DashboardHistory,
                 hide_text: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.history = history
        self.hide_text = hide_text  # tenant cache isolation: no prefix text at all
        self._snapshot: EngineSnapshot | None = None
        self._snapshot_at = 0.0
        self._lock = asyncio.Lock()

    async def snapshot(self) -> EngineSnapshot:
        """The engine's snapshot, fresh within ``MIN_SNAPSHOT_INTERVAL_S``."""
        async with self._lock:  # concurrent viewers wait for the one call in flight
            if self._snapshot is None or time.monotonic() - self._snapshot_at >= MIN_SNAPSHOT_INTERVAL_S:
                self._snapshot = await self.engine.call_utility("snapshot", SNAPSHOT_TIMEOUT_S)
                self._snapshot_at = time.monotonic()
            return self._snapshot

    async def state(self) -> dict[str, Any]:
        """The whole JSON document of ``GET /dashboard/api/state`` (docs/dashboard.md)."""
        snap = await self.snapshot()
        now = time.time()
        h = self.history
        engine = msgspec.to_builtins(msgspec.structs.asdict(snap))
        for req in engine["requests"]:
            req["age_s"] = max(0.0, now - req["arrival_time"])
        engine["prefixes"] = [self._prefix(p) for p in engine["prefixes"]]
        engine["kv_cache_usage"] = snap.num_used_blocks / snap.num_blocks if snap.num_blocks else 0.0
        st = h.stats
        return {
            "time": now,
            "server": {"model": self.model_name, "version": pagoda.__version__, "uptime_s": now - h.started,
                       "engine_pid": self.engine.engine_pid, "interval_s": h.interval_s,
                       "text_hidden": self.hide_text},
            "engine": engine,
            "counters": {**h.totals, "prefix_cache_queries": st.prefix_cache_queries,
                         "prefix_cache_hits": st.prefix_cache_hits, "preemptions": st.num_preemptions,
                         "kv_offload": dict(st.kv_offload)},
            "history": h.history(),
            "finished_by_priority": {k: v.as_dict() for k, v in h.by_priority.items()},
            "finished_by_adapter": {k: v.as_dict() for k, v in h.by_adapter.items()},
        }

    def _prefix(self, prefix: dict[str, Any]) -> dict[str, Any]:
        ids = prefix.pop("preview_token_ids", None)
        prefix["preview"] = None if self.hide_text or prefix.get("salted") or ids is None else \
            self.engine.detokenize(ids)
        return prefix


def dashboard_routes(dashboard: Dashboard, auth: Sequence[Any], auth_codes: tuple[int, ...]
                     ) -> tuple[APIRouter, APIRouter]:
    """The open router (the page and its assets) and the one behind ``auth`` (the snapshot)."""
    public = page_routes()
    api = APIRouter(dependencies=list(auth))

    @api.get(STATE_PATH, responses=error_responses(*auth_codes, 404, 500, 503))
    async def state(model: str | None = None) -> dict[str, Any]:
        """The dashboard's snapshot: requests, KV blocks, hot prefixes, history (docs/dashboard.md);
        ``model``, when given, must be this server's model."""
        if model is not None and model != dashboard.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {dashboard.model_name!r}",
                           param="model", code="model_not_found")
        try:
            return await dashboard.state()
        except (asyncio.TimeoutError, EngineDeadError) as exc:
            raise engine_unavailable(exc) from exc

    return public, api


def page_routes() -> APIRouter:
    """The dashboard page and its assets (open: they hold no data)."""
    public = APIRouter(include_in_schema=False)

    @public.get(DASHBOARD_PATH)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "index.html").read_text(encoding="utf-8"))

    @public.get(STATIC_PREFIX + "{name}")
    async def asset(name: str) -> FileResponse:
        path = STATIC_DIR / name
        # Only the package's own files: no sub-folders, no dot names (``..``).
        if "/" in name or name.startswith(".") or not path.is_file():
            raise APIError(404, f"no dashboard asset {name!r}", code="not_found")
        return FileResponse(path, media_type=_CONTENT_TYPES.get(path.suffix, "application/octet-stream"))

    return public
