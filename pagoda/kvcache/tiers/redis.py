"""The Redis tier (``--kv-offload-redis-url``): blocks shared by every engine that points at the
same Redis, and kept across restarts. Redis's own memory policy (``maxmemory``,
``maxmemory-policy allkeys-lru``) bounds it. Redis down or slow never fails a request: every
call has a short timeout, and an error counts as a miss (the block is recomputed), logged at
most once per ``LOG_EVERY_S`` and counted in ``errors``."""
from __future__ import annotations

import logging
import threading
import time

from pagoda.kvcache.tiers.base import frame, unframe

logger = logging.getLogger(__name__)

KEY_PREFIX = b"pagoda:kv:"
TIMEOUT_S = 0.5
LOG_EVERY_S = 10.0


class RedisTier:
    name = "redis"
    local = False  # a network round trip: never read in the step loop

    def __init__(self, url: str) -> None:
        import redis  # the redis client package (a dependency of this tier only)

        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self.errors = 0
        self.corrupt = 0
        self._last_log = 0.0
        self._lock = threading.Lock()

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            self.errors += 1
            now = time.monotonic()
            if now - self._last_log < LOG_EVERY_S:
                return
            self._last_log = now
        logger.warning("KV Redis tier %s: %s failed (%s: %s); recomputing instead", self.url, what,
                       type(exc).__name__, exc)

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Several blocks in one round trip (MGET); None for each one absent or corrupt."""
        try:
            found = self.client.mget([KEY_PREFIX + k for k in keys])
        except Exception as exc:  # connection refused, timeout, server error: misses
            self._failed("get", exc)
            return [None] * len(keys)
        return [self._check(k, data) for k, data in zip(keys, found)]

    def _check(self, key: bytes, data: bytes | None) -> bytes | None:
        if data is None:
            return None
        payload = unframe(key, data)
        if payload is None:
            logger.warning("KV Redis tier: block %s is corrupt or truncated; dropped", key.hex())
            self.corrupt += 1
            try:
                self.client.delete(KEY_PREFIX + key)
            except Exception as exc:
                self._failed("delete", exc)
        return payload

    def put(self, key: bytes, payload: bytes) -> None:
        try:
            self.client.set(KEY_PREFIX + key, frame(key, payload), nx=True)
        except Exception as exc:
            self._failed("set", exc)

    def contains(self, key: bytes) -> bool | None:
        return None  # only a round trip can tell: ask ``get`` off the step loop

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
