"""OpenMP waiting: how torch's OpenMP worker threads wait between parallel regions.

Nothing here runs at import. The entry points call ``configure_openmp()`` before torch starts
its OpenMP runtime (which reads the settings once): ``pagoda`` (the CLI's ``main``), the offline
``LLM`` (first access to ``pagoda.LLM``, and ``LLMEngine.__init__``) and the API server's
``AsyncEngine`` (before it spawns the engine core). Unless the user chose a policy
(``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` win), the calling process spins briefly
(``GOMP_SPINCOUNT=10000``, about ten microseconds): that bridges the gaps between the ops of
one forward pass, which otherwise pay a thread wake-up per matmul. The server's engine core
inherits the same short spin: beside the API process, which is mostly idle while the engine
steps, sleeping at once cost 1.2-1.4x in time per output token. Long spinning would turn any
oversubscription (tokenizers, tensor-parallel ranks sharing cores) into order-of-magnitude
slowdowns, so tensor-parallel workers, which share the cores with each other by design, are
started with ``OMP_WAIT_POLICY=PASSIVE`` instead (``passive_env``), so an idle worker thread
never holds a core another rank needs. A policy the user set is passed on unchanged.
"""
from __future__ import annotations

import os

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

