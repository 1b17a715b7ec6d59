"""OpenMP waiting for the processes pagoda spawns.

``pagoda/__init__`` gives the importing process a short spin (``GOMP_SPINCOUNT``) unless the
user chose a policy. Processes that share the cores with others by design (the server's engine
core beside the API process; tensor-parallel workers beside each other) are started with
``OMP_WAIT_POLICY=PASSIVE`` instead, so an idle worker thread never holds a core another process
needs. A policy the user set is passed on unchanged.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


def passive_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a copy) for a child that should sleep at once, if pagoda chose the parent's spin."""
    import pagoda

    env = dict(env)
    if "GOMP_SPINCOUNT" in pagoda.OMP_DEFAULTS_SET:
        env.pop("GOMP_SPINCOUNT", None)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


@contextlib.contextmanager
def passive_children() -> Iterator[None]:
    """Processes started inside this block (``multiprocessing`` spawn reads ``os.environ``)
    inherit the passive policy; the parent's own runtime already read its settings."""
    keys = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    saved = {k: os.environ.get(k) for k in keys}
    changed = passive_env(dict(os.environ))
    try:
        for k in keys:
            _set(k, changed.get(k))
        yield
    finally:
        for k, v in saved.items():
            _set(k, v)


def _set(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
