"""pagoda's Ray Serve request router: ``routing.Policy`` behind Serve's request-router extension
point (``ray.serve.request_router.RequestRouter``).

The router lives in the process that holds the deployment handle (the ingress), one per
handle; it sees every request the ingress sends, so its count of requests in flight per replica
is exact for that ingress. A request's routing hints travel in its ``routing`` keyword argument
(a dict): ``hashes`` (its prompt's prefix hashes) and ``avoid`` (replicas that already failed
this request). Routers register themselves by deployment name (``registry.py``) so the ingress
can mark a replica that answered "engine dead" as suspect until it is replaced, and show the
router's counters at ``/debug/router``.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagoda.entrypoints.ray.routing import DEFAULT_PREFIX_AFFINITY_MARGIN, Policy

logger = logging.getLogger(__name__)
# Completions remembered while their routed hook is pending (a completion for a call that is never
# routed would otherwise stay forever); far more than the calls one ingress has in flight.
_MAX_EARLY_COMPLETIONS = 4096


def find_router(deployment: str) -> Optional["PagodaRequestRouter"]:
    """This process's router for ``deployment`` (created by its handle's first request)."""
    import importlib

    return importlib.import_module("pagoda.entrypoints.ray.registry").find(deployment)


class PagodaRequestRouter(RequestRouter):
    """Routes with ``routing.Policy`` (round_robin, least_loaded or prefix_affinity).

    Serve calls ``choose_replicas`` for each request; the groups it returns are tried in order
    and, within a group, the replica with the shortest queue that still has room wins, so a
    full preferred replica never blocks a request."""

    def initialize_state(self, policy: str = "prefix_affinity", margin: int = DEFAULT_PREFIX_AFFINITY_MARGIN,
                         **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"unknown request router options: {', '.join(sorted(kwargs))}")
        self.policy = Policy(policy, margin)
        self.in_flight: collections.Counter[str] = collections.Counter()
        # (internal request id, replica) -> calls in flight. Serve gives every call made while
        # handling one HTTP request the same internal id (the ingress's retries, its fan-out).
        self._routes: collections.Counter[tuple[str, str]] = collections.Counter()
        # Completions Serve reported before the matching ``on_request_routed``: it registers the
        # completion callback first, so a call that finishes while the routing coroutine waits
        # for the event loop completes "before" it was routed. Without this, that late routed
        # hook would count a call that never ends and the replica would look busy for good.
        self._completed_early: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self.suspects: set[str] = set()
        self._known: set[str] = set()
        self._lock = threading.Lock()  # the ingress reads stats() from its own event loop thread
        import importlib  # at call time: this class may arrive by value, with copied globals

        importlib.import_module("pagoda.entrypoints.ray.registry").register(self._deployment_id.name, self)

    # ---- what the ingress asks ---------------------------------------------------------------
    def mark_suspect(self, replica: str) -> None:
        """A replica answered that its engine is gone: no new work until it is replaced."""
        with self._lock:
            if replica in self._known:
                self.suspects.add(replica)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"policy": self.policy.name, "replicas": sorted(self._known), "in_flight": dict(self.in_flight),
                    "affinity_hits": self.policy.affinity_hits, "affinity_overflows": self.policy.affinity_overflows,
                    "suspects": sorted(self.suspects)}

    # ---- Serve's hooks -----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        routing = _routing_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        with self._lock:
            avoid = set(routing.get("avoid") or ()) | self.suspects
            ids = [i for i in by_id if i not in avoid] or list(by_id)
            groups = self.policy.rank(ids, dict(self.in_flight), routing.get("hashes") or ())
        return [[by_id[i] for i in group] for group in groups if group]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        key = (pending_request.metadata.internal_request_id, rid)
        with self._lock:
            self.policy.routed(_routing_of(pending_request).get("hashes") or (), rid)
            early = self._completed_early.get(key, 0)
            if early:  # this call already finished: nothing is in flight
                if early == 1:
                    del self._completed_early[key]
                else:
                    self._completed_early[key] = early - 1
                return
            self.in_flight[rid] += 1
            self._routes[key] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            rid = replica_id.unique_id
            key = (internal_request_id, rid)
            if self._routes[key] > 0:
                self._routes[key] -= 1
                if self._routes[key] == 0:
                    del self._routes[key]
                self.in_flight[rid] -= 1
                if self.in_flight[rid] <= 0:
                    del self.in_flight[rid]
            else:
                self._completed_early[key] = self._completed_early.get(key, 0) + 1
                while len(self._completed_early) > _MAX_EARLY_COMPLETIONS:  # never routed: forget
                    self._completed_early.popitem(last=False)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with self._lock:
            live = {r.replica_id.unique_id for r in replicas}
            for gone in set(self.in_flight) - live:
                del self.in_flight[gone]
            for key in [k for k in self._routes if k[1] not in live]:
                del self._routes[key]
            for key in [k for k in self._completed_early if k[1] not in live]:
                del self._completed_early[key]
            self.suspects &= live
            for gone in self._known - live:  # its cache went with it
                self.policy.removed(gone)
            self._known = live
        logger.info("pagoda router: %d replica(s): %s", len(live), ", ".join(sorted(live)))


def _routing_of(pending_request: Optional[PendingRequest]) -> dict[str, Any]:
    if pending_request is None:
        return {}
    routing = pending_request.kwargs.get("routing")
    return routing if isinstance(routing, dict) else {}
