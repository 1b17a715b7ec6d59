"""The CPUs pagoda sizes its threads by (``pagoda.cpu_quota``, ``omp.configure_openmp``): a cgroup
CPU quota read from v2 and v1 hierarchies laid out in a folder, and a real quota: a child process
placed in a cgroup of its own with one CPU of time runs torch with one thread."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pagoda import cpu_quota


def _root(tmp_path: Path, mountinfo: list[str], cgroup: list[str], files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    (tmp_path / "proc/self/cgroup").write_text("\n".join(cgroup) + "\n")
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp_path


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU_MOUNT = "32 23 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct"
V1_MEMORY_MOUNT = "35 23 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"


def test_v2_quota_of_the_process_cgroup(tmp_path):
    root = _root(tmp_path, [V2_MOUNT], ["0::/"], {"/sys/fs/cgroup/cpu.max": "150000 100000"})
    assert cpu_quota.cgroup_cpu_limit(root) == 1.5


def test_v2_without_a_quota_is_none(tmp_path):
    root = _root(tmp_path, [V2_MOUNT], ["0::/"], {"/sys/fs/cgroup/cpu.max": "max 100000"})
    assert cpu_quota.cgroup_cpu_limit(root) is None


def test_the_tightest_of_the_cgroup_and_its_ancestors_holds(tmp_path):
    """A systemd slice with a 3-CPU limit above a service cgroup with none and a child with 6."""
    root = _root(tmp_path, [V2_MOUNT], ["0::/work.slice/job.service/worker"], {
        "/sys/fs/cgroup/cpu.max": "max 100000",
        "/sys/fs/cgroup/work.slice/cpu.max": "300000 100000",
        "/sys/fs/cgroup/work.slice/job.service/cpu.max": "max 100000",
        "/sys/fs/cgroup/work.slice/job.service/worker/cpu.max": "600000 100000"})
    assert cpu_quota.cgroup_cpu_limit(root) == 3.0


def test_v1_quota_of_the_cpu_controller(tmp_path):
    root = _root(tmp_path, [V1_MEMORY_MOUNT, V1_CPU_MOUNT], ["5:memory:/pod", "4:cpu,cpuacct:/pod", "0::/"], {
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
        "/sys/fs/cgroup/cpu,cpuacct/pod/cpu.cfs_quota_us": "250000",
        "/sys/fs/cgroup/cpu,cpuacct/pod/cpu.cfs_period_us": "100000",
        "/sys/fs/cgroup/memory/pod/cpu.cfs_quota_us": "10000"})  # not the CPU controller's: ignored
    assert cpu_quota.cgroup_cpu_limit(root) == 2.5


def test_v1_without_a_quota_is_none(tmp_path):
    root = _root(tmp_path, [V1_CPU_MOUNT], ["4:cpu,cpuacct:/"], {
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cpu_quota.cgroup_cpu_limit(root) is None


def test_a_container_without_its_own_cgroup_namespace(tmp_path):
    """The container's cgroup mounted as the hierarchy's root (mount root ``/docker/abc``) while
    ``/proc/self/cgroup`` names its full path: the quota is read at the mount point."""
    mount = "40 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw"
    root = _root(tmp_path, [mount], ["0::/docker/abc"], {"/sys/fs/cgroup/cpu.max": "200000 100000"})
    assert cpu_quota.cgroup_cpu_limit(root) == 2.0


def test_nothing_readable_is_none(tmp_path):
    assert cpu_quota.cgroup_cpu_limit(tmp_path) is None
    root = _root(tmp_path / "x", [V2_MOUNT], ["0::/"], {})  # a mount without the cpu controller's files
    assert cpu_quota.cgroup_cpu_limit(root) is None


@pytest.mark.parametrize("limit, visible, usable", [(None, 8, 8), (2.5, 8, 2), (0.5, 8, 1), (16.0, 8, 8)])
def test_usable_cpus_rounds_the_quota_down(monkeypatch, limit, visible, usable):
    monkeypatch.setattr(cpu_quota, "cgroup_cpu_limit", lambda root="/": limit)
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: visible)
    assert cpu_quota.usable_cpus() == usable


_CHILD = ("import json, os; from pagoda.omp import configure_openmp; configure_openmp(); import torch; "
          "print(json.dumps([torch.get_num_threads(), os.environ.get('OMP_NUM_THREADS')]))")


def _writable_cpu_cgroup() -> Path | None:
    """A v1 CPU-controller folder or a v2 one with the cpu controller, where this process may
    make cgroups (root in a container with a writable cgroup mount); None elsewhere."""
    for mount_version, _, point in cpu_quota._mounts(Path("/")):
        top = Path(point)
        wanted = "cpu.cfs_quota_us" if mount_version == "1" else "cgroup.subtree_control"
        if not (top / wanted).exists() or not os.access(top, os.W_OK):
            continue
        if mount_version == "2" and "cpu" not in (top / "cgroup.subtree_control").read_text().split():
            continue
        return top
    return None


@pytest.mark.skipif(cpu_quota.affinity_cpus() < 2, reason="one CPU: a one-CPU quota changes nothing")
@pytest.mark.skipif(_writable_cpu_cgroup() is None, reason="no cgroup with the cpu controller this user may make")
def test_a_process_under_a_one_cpu_quota_runs_one_thread():
    """A real cgroup with one CPU of time (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``): pagoda's
    OpenMP set-up gives torch one thread there; a count the user set wins; outside it, one
    thread per CPU of the affinity mask."""
    top = _writable_cpu_cgroup()
    group = top / f"pagoda-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        if (group / "cpu.max").exists():
            (group / "cpu.max").write_text("100000 100000")
            procs = group / "cgroup.procs"
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("100000")
            procs = group / "tasks"

        def run(env: dict[str, str], inside: bool = True) -> list:
            join = (lambda: procs.write_text(str(os.getpid()))) if inside else None
            out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True,
                                 env=env, preexec_fn=join)
            return json.loads(out.stdout.strip().splitlines()[-1])

        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        assert run(base) == [1, "1"]
        assert run(base | {"OMP_NUM_THREADS": "2"}) == [2, "2"]
        visible = cpu_quota.affinity_cpus()
        outside = run(base, inside=False)
        if cpu_quota.cgroup_cpu_limit() is None:  # this process itself has no quota
            assert outside == [visible, None]
    finally:
        for _ in range(50):  # the child has exited; its cgroup empties at once
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_the_visible_cpus_peer_runs_a_thread_per_cpu_of_the_affinity_mask(monkeypatch):
    """``pagoda bench peers --engines pagoda@visible-cpus``: the child's environment sets
    ``OMP_NUM_THREADS`` to the affinity mask's CPUs whatever the parent chose."""
    from pagoda.bench import peers

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: 7)
    assert peers.child_engine_env("pagoda@visible-cpus")["OMP_NUM_THREADS"] == "7"
    assert peers.child_engine_env("pagoda@scalar")["PAGODA_CPU_ISA"] == "scalar"
