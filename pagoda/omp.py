"""OpenMP waiting: how torch's OpenMP worker threads wait between parallel regions.

Nothing here runs at import. The entry points call ``configure_openmp()`` before torch starts
its OpenMP runtime (which reads the settings once): ``pagoda`` (the CLI's ``main``), the offline
``LLM`` (first access to ``pagoda.LLM``, and ``LLMEngine.__init__``) and the API server's
``AsyncEngine`` (before it spawns the engine core). Unless the user chose a policy
(``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` win), the calling process spins briefly
(``GOMP_SPINCOUNT=10000``, about ten microseconds): that bridges the gaps between the ops of
one forward pass, which otherwise pay a thread wake-up per matmul. Long spinning would turn any
oversubscription (the API server, tokenizers, tensor-parallel ranks sharing cores) into
order-of-magnitude slowdowns, so processes that share the cores with others by design (the
server's engine core beside the API process; tensor-parallel workers beside each other) are
started with ``OMP_WAIT_POLICY=PASSIVE`` instead (``passive_env``, ``passive_children``), so an
idle worker thread never holds a core another process needs. A policy the user set is passed on
unchanged.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

SPIN_COUNT = "10000"
# What ``configure_openmp`` set, so children (and benchmark peers) can run without it.
OMP_DEFAULTS_SET: dict[str, str] = {}


def configure_openmp() -> None:
    """Give this process pagoda's short spin unless the user set a policy. Idempotent; only
    effective before torch is first imported in this process."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        OMP_DEFAULTS_SET["GOMP_SPINCOUNT"] = os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def passive_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a copy) for a child that should sleep at once, if pagoda chose the parent's spin."""
    env = dict(env)
    if "GOMP_SPINCOUNT" in OMP_DEFAULTS_SET:
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
