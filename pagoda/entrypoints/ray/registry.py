"""The request routers of this process, by deployment name, so the ingress (which holds the
deployment handle) can ask its router for the replica list. Serve may ship the router class
by value (cloudpickle), with copies of its module's globals; code reaches this registry by
importing this module at call time, which always finds the one real module."""
from __future__ import annotations

import threading
from typing import Any

ROUTERS: dict[str, Any] = {}
LOCK = threading.Lock()


def register(deployment: str, router: Any) -> None:
    with LOCK:
        ROUTERS[deployment] = router


def find(deployment: str) -> Any:
    with LOCK:
        return ROUTERS.get(deployment)
