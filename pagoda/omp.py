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

The thread count: where a cgroup CPU quota (a container's ``--cpus``, a Kubernetes CPU limit)
allows less time than the affinity mask has CPUs, ``OMP_NUM_THREADS`` is set to the quota
(``cpu_quota.usable_cpus``) unless the user set it: one thread per visible core would have each
op wait at its barrier for threads the quota has descheduled.
"""
from __future__ import annotations

import os
import sys

from pagoda.cpu_quota import affinity_cpus, usable_cpus

SPIN_COUNT = "10000"
# What ``configure_openmp`` set, so children (and benchmark peers) can run without it.
OMP_DEFAULTS_SET: dict[str, str] = {}


def configure_openmp() -> None:
    """Give this process pagoda's short spin unless the user set a policy, and no more threads
    than a CPU quota allows unless the user set a count. Idempotent; the spin is only effective
    before torch is first imported in this process."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        OMP_DEFAULTS_SET["GOMP_SPINCOUNT"] = os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    if "OMP_NUM_THREADS" not in os.environ and (usable := usable_cpus()) < affinity_cpus():
        OMP_DEFAULTS_SET["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(usable)
        torch = sys.modules.get("torch")
        if torch is not None and torch.get_num_threads() > usable:  # started already: size its pool now
            torch.set_num_threads(usable)


def passive_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` (a copy) for a child that should sleep at once, if pagoda chose the parent's spin."""
    env = dict(env)
    if "GOMP_SPINCOUNT" in OMP_DEFAULTS_SET:
        env.pop("GOMP_SPINCOUNT", None)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env



def threads_reason() -> str:
    """Why torch runs the threads it does (for the start-up log and ``pagoda env``)."""
    from pagoda.cpu_quota import cgroup_cpu_limit

    limit, visible = cgroup_cpu_limit(), affinity_cpus()
    if "OMP_NUM_THREADS" in OMP_DEFAULTS_SET:
        return f"the cgroup CPU quota: {limit:g} CPUs of time for {visible} in the affinity mask"
    quota = f", cgroup CPU quota {limit:g}" if limit is not None else ""
    if "OMP_NUM_THREADS" in os.environ:
        return f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (set by the user; {visible} CPUs in the affinity mask{quota})"
    return f"{visible} CPUs in the affinity mask{quota}"
