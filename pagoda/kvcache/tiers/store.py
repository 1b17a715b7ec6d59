"""The tiers in lookup order, and the two worker threads that do their I/O off the step loop.

``save_async`` hands a batch of block snapshots to the saver thread through a bounded queue:
when the queue is full the batch is dropped (counted in ``stats.dropped``), so a slow tier
never stalls a step; the blocks are recomputed if they are needed again. ``lookup_async``
starts a ``LoadJob`` on the loader thread: it reads the blocks of a key chain from the first
tier that has each, stopping at the first block no tier has (a later block is useless without
it), while the request waits in the queue. A block whose write is still queued (evicted a
moment ago) is waited for, not missed.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pagoda.kvcache.tiers.base import SaveItem, Tier

logger = logging.getLogger(__name__)

# Batches of block snapshots waiting for the saver (one batch per step at most).
SAVE_QUEUE_BATCHES = 64
# The longest a lookup waits for a queued write of the block it wants (then: a miss).
SAVE_WAIT_S = 1.0
# Blocks a tier that reads many at once (Redis MGET) is asked for per round trip.
GET_MANY = 32


@dataclass
class TierStats:
    """Running totals, in blocks: found per tier, lookups ended by a block no tier had,
    written per tier, and snapshots dropped because the save queue was full; per tier also
    the bytes read and written and the time spent in its reads and writes (seconds)."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    saved: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)
    bytes_written: dict[str, int] = field(default_factory=dict)
    read_s: dict[str, float] = field(default_factory=dict)
    write_s: dict[str, float] = field(default_factory=dict)


class LoadJob:
    """Reading the blocks of ``keys`` (a chain: block ``start`` on) from the tiers. When ``done``,
    ``payloads`` holds the leading blocks found, and ``sources`` the tier each came from."""

    def __init__(self, keys: list[bytes], start: int, num_tokens: int) -> None:
        self.keys = keys
        self.start = start
        self.num_tokens = num_tokens
        self.payloads: list[bytes] = []
        self.sources: list[str] = []
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class TieredStore:
    """Tiers (host, disk, Redis: whichever are configured, in that order) behind worker threads."""

    def __init__(self, tiers: list[Tier]) -> None:
        if not tiers:
            raise ValueError("a tiered KV store needs at least one tier")
        self.tiers = tiers
        self.by_name = {t.name: t for t in tiers}
        self.payload_bytes: int | None = None  # a block's payload size, set by the executor
        zeros = lambda: dict.fromkeys(self.by_name, 0)  # noqa: E731
        self.stats = TierStats(hits=zeros(), saved=zeros(), bytes_read=zeros(), bytes_written=zeros(),
                               read_s=zeros(), write_s=zeros())
        self._saves: queue.Queue = queue.Queue(maxsize=SAVE_QUEUE_BATCHES)
        self._loads: queue.Queue = queue.Queue()
        self._load_finished = threading.Condition()
        # Keys queued for the saver and not written yet: a lookup of one waits for its write.
        self._saving: dict[bytes, int] = {}
        self._saved = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._save_loop, name="kv-tier-saver", daemon=True),
                         threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- from the step loop --------------------------------------------------------------
    def save_async(self, items: list[SaveItem], payloads: Callable[[], list[bytes]]) -> bool:
        """Queue ``items`` (``payloads()``, run on the saver thread, gives their bytes in order).
        False, dropping them, when the queue is full."""
        with self._saved:
            try:
                self._saves.put_nowait((items, payloads))
            except queue.Full:
                self.stats.dropped += len(items)
                return False
            for item in items:
                self._saving[item.key] = self._saving.get(item.key, 0) + 1
        return True

    def lookup_async(self, keys: list[bytes], start: int, num_tokens: int) -> LoadJob:
        job = LoadJob(keys, start, num_tokens)
        self._loads.put(job)
        return job

    def may_hold(self, key: bytes) -> bool:
        """Whether a lookup of ``key`` could find it, answered without I/O (a remote tier
        always could)."""
        return key in self._saving or any(t.contains(key) is not False for t in self.tiers)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a lookup to finish (the step loop calls it when nothing
        else can run, so an engine waiting for its blocks does not spin)."""
        with self._load_finished:
            if self._loads.unfinished_tasks:
                self._load_finished.wait(timeout)

    def drain(self) -> None:
        """Wait until every queued save and lookup is done (shutdown, tests)."""
        self._saves.join()
        self._loads.join()

    def close(self) -> None:
        """Finish the queued work, stop the threads, release the tiers."""
        if self._closed:
            return
        self._closed = True
        self._saves.put((None, None))
        self._loads.put(None)
        for t in self._threads:
            t.join(timeout=30)
        for tier in self.tiers:
            tier.close()

    # ---- worker threads ------------------------------------------------------------------
    def _save_loop(self) -> None:
        while True:
            items, payloads = self._saves.get()
            try:
                if items is None:
                    return
                self._save(items, payloads())
            except Exception:
                logger.exception("KV tier save failed; those blocks will be recomputed when needed")
            finally:
                if items is not None:
                    self._done_saving(items)
                self._saves.task_done()

    def _done_saving(self, items: list[SaveItem]) -> None:
        with self._saved:
            for item in items:
                left = self._saving.pop(item.key, 1) - 1
                if left > 0:
                    self._saving[item.key] = left
            self._saved.notify_all()

    def _save(self, items: list[SaveItem], payloads: list[bytes]) -> None:
        for item, payload in zip(items, payloads):
            for name in item.tiers:
                start = time.perf_counter()
                self.by_name[name].put(item.key, payload)
                self.stats.write_s[name] += time.perf_counter() - start
                self.stats.saved[name] += 1
                self.stats.bytes_written[name] += len(payload)

    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            try:
                if job is None:
                    return
                self._load(job)
            except Exception:
                logger.exception("KV tier lookup failed; the prefix will be recomputed")
            finally:
                if job is not None:
                    job._done.set()
                self._loads.task_done()
                with self._load_finished:
                    self._load_finished.notify_all()

    def _load(self, job: LoadJob) -> None:
        batched: dict[bytes, bytes | None] = {}  # read ahead from tiers that read many at once
        for i, key in enumerate(job.keys):
            found = self._get(key, job.keys[i:i + GET_MANY], batched)
            if found is None:
                self.stats.misses += 1
                return
            job.payloads.append(found[0])
            job.sources.append(found[1])
            self.stats.hits[found[1]] += 1

    def _get(self, key: bytes, ahead: list[bytes], batched: dict[bytes, bytes | None]) -> tuple[bytes, str] | None:
        """``key``'s payload and the tier it came from. A tier with ``get_many`` (Redis) reads
        ``ahead`` (this key and the next ones of the chain) in one round trip into ``batched``."""
        with self._saved:  # evicted a moment ago: its write is queued, wait for it
            self._saved.wait_for(lambda: key not in self._saving, timeout=SAVE_WAIT_S)
        for tier in self.tiers:
            if tier.contains(key) is False:
                continue
            start = time.perf_counter()
            get_many = getattr(tier, "get_many", None)
            if get_many is not None and key not in batched:
                batched.update(zip(ahead, get_many(ahead)))
            payload = batched.pop(key, None) if get_many is not None else tier.get(key)
            self.stats.read_s[tier.name] += time.perf_counter() - start
            if payload is None:
                continue
            self.stats.bytes_read[tier.name] += len(payload)
            if self.payload_bytes is not None and len(payload) != self.payload_bytes:
                logger.warning("KV tier %s: block %s has %d bytes, expected %d; ignored", tier.name, key.hex(),
                               len(payload), self.payload_bytes)
                continue
            return payload, tier.name
        return None
