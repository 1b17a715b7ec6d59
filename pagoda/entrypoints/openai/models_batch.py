"""The Files and Batch API of a several-models server: each batch line goes through the server's
own app, so ``ModelDispatch`` routes it by its ``model`` like any request (loading the model if
need be). ``FleetGate`` starts a line only while no loaded model is short of room, and a line is
sent at the batch priority class when its own model schedules by priority."""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pagoda.entrypoints.openai.batch.protocol import BATCH_ENDPOINTS
from pagoda.entrypoints.openai.batch.runner import (DEFAULT_MAX_CONCURRENT_BATCH_REQUESTS, GATE_POLL_S, BatchGate,
                                                    batch_priority)
from pagoda.entrypoints.openai.batch.service import (DEFAULT_MAX_BATCH_FILE_BYTES, DEFAULT_MAX_REQUESTS_PER_BATCH,
                                                     BatchLimits, BatchService)
from pagoda.entrypoints.openai.batch.storage import BatchStorage
from pagoda.entrypoints.openai.models_router import ModelRegistry
from pagoda.entrypoints.openai.serving_common import APIError
from pagoda.entrypoints.openai.tenants import TenantPolicy


class FleetGate:
    """At most ``cap`` batch lines at once, each started only while every loaded model has a
    free sequence slot and no request waiting for one (``BatchGate``'s rule, for each engine),
    so interactive requests never queue behind batch lines on any model."""

    def __init__(self, registry: ModelRegistry, cap: int) -> None:
        self.registry = registry
        self.cap = max(1, cap)
        self.active = 0

    def _room(self) -> bool:
        if self.active >= self.cap:
            return False
        engines = [s.loaded.engine for s in self.registry.slots.values()
                   if s.loaded is not None and not s.loaded.engine.is_dead]
        # A gate of one line per engine answers "has this engine room" by the single server's rule.
        return all(BatchGate(engine, 1)._room() for engine in engines)

    async def acquire(self) -> None:
        while not self._room():
            await asyncio.sleep(GATE_POLL_S)
        self.active += 1

    def release(self) -> None:
        self.active -= 1


class RoutedBatchService(BatchService):
    """``BatchService`` over several models (see the module's docstring)."""

    def __init__(self, registry: ModelRegistry, storage: BatchStorage, tenants: TenantPolicy, limits: BatchLimits,
                 max_concurrent: int, api_key: str | None) -> None:
        super().__init__(None, storage, tenants, limits, max_concurrent, api_key, BATCH_ENDPOINTS)
        self.registry = registry
        self.gate = FleetGate(registry, max_concurrent)  # type: ignore[assignment]

    def line_priority(self, body: dict[str, Any]) -> int | None:
        try:
            slot = self.registry.lookup(body.get("model"))
        except APIError:
            return None  # the line gets its own 400 or 404 from the dispatcher
        return batch_priority(slot.spec.args.scheduling_policy)


def build_routed_batch_service(args: argparse.Namespace, registry: ModelRegistry,
                               tenants: TenantPolicy) -> RoutedBatchService:
    """The service from the batch flags (raises ``StorageInUseError`` or ``OSError``)."""
    storage = BatchStorage(getattr(args, "batch_storage_dir", None))
    limits = BatchLimits(getattr(args, "max_batch_file_bytes", DEFAULT_MAX_BATCH_FILE_BYTES),
                         getattr(args, "max_requests_per_batch", DEFAULT_MAX_REQUESTS_PER_BATCH))
    return RoutedBatchService(registry, storage, tenants, limits,
                              getattr(args, "max_concurrent_batch_requests", DEFAULT_MAX_CONCURRENT_BATCH_REQUESTS),
                              args.api_key)
