"""How many CPUs this process may keep busy: its affinity mask, and its cgroup's CPU quota.

A container limited with ``docker run --cpus=4`` or a Kubernetes CPU limit sees every core of
the host (``os.cpu_count()``, and usually its affinity mask too) but gets only 4 CPUs' worth of
time: the kernel's CFS quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``). torch starts one OpenMP thread per CPU of the affinity mask, so a
forward pass there splits every op over 64 threads that run 4 at a time, and each op's barrier
waits for threads the quota has descheduled. ``usable_cpus`` is what pagoda sizes its threads by
(``omp.configure_openmp``, the tensor-parallel ranks' share); ``OMP_NUM_THREADS`` still wins.

The quota is read as the process's own cgroup and every ancestor up to the mount's root (a
parent's limit holds for its children), on cgroup v2 and v1 mounts alike, from
``/proc/self/mountinfo`` and ``/proc/self/cgroup`` (a container with its own cgroup namespace
sees its cgroup as ``/``; one without sees its full path, which the mount's root is cut from).
No torch import: the OpenMP settings must be made before torch starts.
"""
from __future__ import annotations

import math
import os
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _limit_v2(directory: Path) -> float | None:
    """CPUs of ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD": none) in ``directory``."""
    text = _read(directory / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _limit_v1(directory: Path) -> float | None:
    """CPUs of ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us`` in ``directory``."""
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0 or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _mounts(root: Path) -> list[tuple[str, str, str]]:
    """(version "1" or "2", mount root, mount point) of the cgroup mounts that carry the CPU
    controller (v1: mounts whose options name ``cpu``; v2: every cgroup2 mount)."""
    text = _read(root / "proc/self/mountinfo") or ""
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            found.append(("2", fields[3], fields[4]))
        elif fstype == "cgroup" and "cpu" in options:
            found.append(("1", fields[3], fields[4]))
    return found


def _cgroup_paths(root: Path) -> dict[str, str]:
    """This process's cgroup path per version ("2": the unified one, "1": the CPU controller's)."""
    paths: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths["2"] = path
        elif "cpu" in controllers.split(","):
            paths["1"] = path
    return paths


def cgroup_cpu_limit(root: str | os.PathLike = "/") -> float | None:
    """The CPUs' worth of time this process's cgroups allow (the tightest quota of its cgroup and
    its ancestors, v2 or v1), or None where no quota applies or nothing can be read. ``root``
    stands for ``/`` (tests pass a folder laid out like one)."""
    root = Path(root)
    paths = _cgroup_paths(root)
    limits = []
    for version, mount_root, mount_point in _mounts(root):
        path = paths.get(version)
        if path is None:
            continue
        if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
            path = path[len(mount_root):]  # a mount of a subtree (a container without a cgroup namespace)
        top = root / mount_point.lstrip("/")
        directory = top / path.strip("/")
        read = _limit_v2 if version == "2" else _limit_v1
        while True:
            limit = read(directory)
            if limit is not None:
                limits.append(limit)
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs of this process's affinity mask (``os.cpu_count()`` where there is no such call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cpus() -> int:
    """Threads worth running: the affinity mask's CPUs, fewer where a cgroup quota allows less
    time (rounded down: 2.5 CPUs of time keep 2 threads busy without throttling), at least 1."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)
