"""The tiers in lookup order, and the two worker threads that do their I/O off the step loop.

``save_async`` hands a batch of block snapshots to the saver thread through a bounded queue:
when the queue is full the batch is dropped (counted in ``stats.dropped``), so a slow tier
never stalls a step; the blocks are recomputed if they are needed again. ``lookup_async``
starts a ``LoadJob`` on the loader thread: it reads the blocks of a key chain from the first
tier that has each, stopping at the first block no tier has (a later block is useless without
it), while the request waits in the queue. A block whose write is still queued (evicted a
moment ago) is waited for, not missed. ``lookup_now`` answers a chain that host memory alone
holds at once, in the step loop (no I/O, no thread hop, no step spent waiting).
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
        self._local = all(getattr(t, "local", False) for t in tiers)  # no tier needs a round trip
        # Lookups run on the loader thread and in the step loop (lookup_now, an idle loop's
        # wait_for_loads) at once: their read totals are added under this.
        self._read_stats = threading.Lock()
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

    def lookup_now(self, keys: list[bytes], start: int, num_tokens: int) -> LoadJob | None:
        """The lookup of ``keys`` done at once in the calling thread (a finished job) when host
        memory alone answers it: the chain's leading blocks the host tier holds, and after
        them a block no other tier (nor a queued write) can hold. None otherwise (a block may
        be on disk, in Redis or on its way: ``lookup_async``). Host memory needs no I/O, so
        the step loop asks here first, and a request whose prefix it holds starts in the same
        step instead of waiting a step for the loader thread."""
        host = self.tiers[0]
        if host.name != "cpu":
            return None
        job = LoadJob(keys, start, num_tokens)
        begin = time.perf_counter()
        for key in keys:
            payload = host.get(key) if key not in self._saving else None
            if payload is None or len(payload) != (self.payload_bytes or len(payload)):
                if self.may_hold(key, below_host=True):
                    return None
                break
            job.payloads.append(payload)
            job.sources.append(host.name)
        with self._read_stats:
            self.stats.misses += len(job.payloads) < len(keys)
            self.stats.read_s[host.name] += time.perf_counter() - begin
            self.stats.hits[host.name] += len(job.payloads)
            self.stats.bytes_read[host.name] += sum(map(len, job.payloads))
        job._done.set()
        return job

    def may_hold(self, key: bytes, below_host: bool = False) -> bool:
        """Whether a lookup of ``key`` could find it, answered without I/O (a remote tier
        always could); ``below_host``: a tier other than host memory could."""
        tiers = self.tiers[1:] if below_host and self.tiers[0].name == "cpu" else self.tiers
        return key in self._saving or any(t.contains(key) is not False for t in tiers)

    def wait_for_loads(self, timeout: float) -> None:
        """The step loop calls it when nothing else can run. A lookup still queued is done
        right here: no request waits on this thread now, and on a busy machine the loader
        thread may not get a CPU for a while. Else block up to ``timeout`` s for the one in
        flight (so an engine waiting for its blocks does not spin). With a remote tier (Redis:
        a slow one takes up to its timeout) lookups stay on the loader thread, so a request
        arriving meanwhile is not held up."""
        try:
            if not self._local:
                raise queue.Empty
            job = self._loads.get_nowait()
        except queue.Empty:
            with self._load_finished:
                if self._loads.unfinished_tasks:
                    self._load_finished.wait(timeout)
            return
        if job is None:  # closing: the loader thread's stop mark goes back
            self._loads.task_done()
            self._loads.put(None)
            return
        self._run_load(job)

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
            if job is None:
                self._loads.task_done()
                return
            self._run_load(job)

    def _run_load(self, job: LoadJob) -> None:
        """Do ``job`` (taken off the queue) and mark it done, whatever happens."""
        try:
            self._load(job)
        except Exception:
            logger.exception("KV tier lookup failed; the prefix will be recomputed")
        finally:
            job._done.set()
            self._loads.task_done()
            with self._load_finished:
                self._load_finished.notify_all()

    def _load(self, job: LoadJob) -> None:
        batched: dict[bytes, bytes | None] = {}  # read ahead from tiers that read many at once
        for i, key in enumerate(job.keys):
            found = self._get(key, job.keys[i:i + GET_MANY], batched)
            if found is None:
                with self._read_stats:
                    self.stats.misses += 1
                return
            job.payloads.append(found[0])
            job.sources.append(found[1])
            with self._read_stats:
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
            with self._read_stats:
                self.stats.read_s[tier.name] += time.perf_counter() - start
            if payload is None:
                continue
            with self._read_stats:
                self.stats.bytes_read[tier.name] += len(payload)
            if self.payload_bytes is not None and len(payload) != self.payload_bytes:
                logger.warning("KV tier %s: block %s has %d bytes, expected %d; ignored", tier.name, key.hex(),
                               len(payload), self.payload_bytes)
                continue
            return payload, tier.name
        return None
