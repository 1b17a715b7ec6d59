"""Priorities and deadlines of waiting and running requests. Pure Python.

Under the priority policy (``--scheduling-policy priority``) the waiting queue is kept in
``(priority, arrival)`` order: a lower ``priority`` runs first (vLLM's meaning), equal priorities
in arrival order. A waiting request that finds no sequence slot or KV block preempts the running
sequence of the highest priority value (the newest of them) when that value is strictly higher
than its own; a running sequence short of a block preempts the same victim. With requests of
several tenants the fair shares come first (``fair_share.py``): tenants are admitted by load,
and each tenant's own queue is in priority order.

Deadlines: ``--max-queue-time`` bounds how long a request may wait before it first runs, and a
request's own ``timeout`` bounds its whole life. ``Deadlines`` is a heap of both, so a step
looks at its front only (nothing per step when no request has one).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import weakref
from collections import deque
from typing import Iterable

from pagoda.request import Request, Sequence

# The priority the Batch API submits its requests at: after every interactive request of the
# default priority 0, and preempted by them under the priority policy.
BATCH_PRIORITY = 10
# The finish reason of a request whose own deadline (``timeout``) passed while it was running.
TIMEOUT_FINISH_REASON = "timeout"
# The failure reason of a request whose deadline passed while it waited; the engine reports it
# as a 503 (``engine/core.py``) and the server adds ``Retry-After``.
QUEUE_TIMEOUT_PREFIX = "queue_timeout: "


def priority_label(priority: int) -> str:
    """A priority's metric label: the value within [-BATCH_PRIORITY, BATCH_PRIORITY], else the
    side it is out on (so labels stay few whatever priorities clients send)."""
    if priority < -BATCH_PRIORITY:
        return f"<-{BATCH_PRIORITY}"
    if priority > BATCH_PRIORITY:
        return f">{BATCH_PRIORITY}"
    return str(priority)


def priority_key(seq: Sequence) -> tuple[int, float]:
    """The waiting order of the priority policy: lower first."""
    return seq.request.priority, seq.request.arrival_time


def insert_waiting(queue: deque[Sequence], seq: Sequence) -> None:
    """Put ``seq`` into the priority-ordered ``queue`` after every sequence that goes before or
    with it (a preempted sequence goes back among the requests of its own priority by arrival)."""
    queue.insert(bisect.bisect_right(queue, priority_key(seq), key=priority_key), seq)


def preemptible(running: Iterable[Sequence], priority: int) -> Sequence | None:
    """The running sequence to preempt for a sequence of ``priority``: the newest of those with
    the highest priority value, if that value is above ``priority``; else None."""
    victim = None
    for seq in running:  # admission order: on a tie the later one wins
        if victim is None or seq.request.priority >= victim.request.priority:
            victim = seq
    return victim if victim is not None and victim.request.priority > priority else None


class Deadlines:
    """The pending deadlines of requests, soonest first: ``"queue"`` (it must have started by
    then) and ``"end"`` (it must have finished by then). Entries hold their request weakly (a
    long timeout keeps no finished request alive); those of requests gone are skipped when due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, weakref.ref[Request]]] = []
        self._order = itertools.count()  # ties: first added first; Requests are never compared

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, when: float, kind: str, request: Request) -> None:
        heapq.heappush(self._heap, (when, next(self._order), kind, weakref.ref(request)))

    def due(self, now: float) -> list[tuple[str, Request]]:
        """Remove and return the deadlines at or before ``now``."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, kind, ref = heapq.heappop(self._heap)
            request = ref()
            if request is not None:
                out.append((kind, request))
        return out
