"""Replicas started from a folder that holds another ``pagoda`` (a checkout, a data folder):
Ray puts the driver's working directory first on its workers' ``sys.path``, so they imported
that one and failed, and the replica's ``__del__`` hid the real error behind an
``AttributeError``."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pagoda
from pagoda.entrypoints.ray.deployments import EngineReplica
from pagoda.tools.netns import netns_command

# Ray started as ``pagoda serve --num-replicas`` starts it, then one task reports which pagoda
# a worker imports. ``python -P`` keeps the driver itself from importing the folder's pagoda
# (as the installed ``pagoda`` command does).
PROBE = """
import argparse, json, os, ray
import pagoda
from pagoda.entrypoints.ray.server import start_ray

args = argparse.Namespace(ray_address=None, num_replicas=1, max_replicas=None, min_replicas=None,
                          replica_num_cpus=1)
start_ray(args)

@ray.remote(num_cpus=0)
def where():
    import pagoda
    return pagoda.__file__

print(json.dumps({"driver": pagoda.__file__, "worker": ray.get(where.remote()), "cwd": os.getcwd()}))
ray.shutdown()
"""


def test_ray_workers_import_the_drivers_pagoda(tmp_path: Path) -> None:
    (tmp_path / "pagoda").mkdir()
    (tmp_path / "pagoda" / "__init__.py").write_text("")  # some other project's package
    env = {**os.environ, "PYTHONPATH": str(Path(pagoda.__file__).resolve().parents[1])}
    out = subprocess.run(netns_command([sys.executable, "-P", "-c", PROBE]), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-5000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["worker"] == found["driver"] == str(Path(pagoda.__file__).resolve())
    assert found["cwd"] == str(tmp_path)  # the driver's own folder is unchanged


def test_a_failed_replica_start_keeps_its_own_error() -> None:
    """Outside a Serve replica the start fails at once; the clean-up Serve then runs must not
    raise an error of its own (it raised AttributeError '_stat_task')."""
    class Replica(EngineReplica):
        def __del__(self) -> None:  # Serve awaits the real one (done by hand below), not the collector
            pass

    replica = Replica.__new__(Replica)
    args = type("Args", (), {"log_level": "warning"})()
    try:
        asyncio.run(replica.__init__(args))
    except Exception as exc:  # the real reason: not inside a replica
        assert not isinstance(exc, AttributeError), exc
    else:
        raise AssertionError("a replica started outside Ray Serve")
    asyncio.run(EngineReplica.__del__(replica))
