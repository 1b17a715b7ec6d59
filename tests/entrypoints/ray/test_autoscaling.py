"""Autoscaling on real Ray Serve: ``pagoda serve --min-replicas 1 --max-replicas 2
--target-ongoing-requests 1`` starts one replica, and a steady queue of requests above the target
makes Ray Serve start the second (Ray's own autoscaler; the load must stay above the target for
``--autoscaling-upscale-delay`` 2 s instead of Ray's default 30), which then serves; every request
of the load completes."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from ray_helpers import RayServer

SCALE_UP_TIMEOUT_S = 240.0  # Ray Serve waits ~30 s of sustained load before it scales up


def test_queue_above_the_target_adds_a_replica(llama_dir: Path, tmp_path: Path) -> None:
    server = RayServer(llama_dir, tmp_path, "--min-replicas", "1", "--max-replicas", "2",
                       "--target-ongoing-requests", "1", "--autoscaling-upscale-delay", "2",
                       "--served-model-name", "tiny", "--kv-cache-memory", "32MiB",
                       "--max-model-len", "512", "--replica-num-cpus", "0.5", "--disable-log-stats")
    stop = threading.Event()
    done: list[str] = []
    errors: list[BaseException] = []

    def load(worker: int) -> None:
        client = server.openai(timeout=120)
        while not stop.is_set():
            try:
                out = client.completions.create(model="tiny", prompt=f"Load {worker}: once upon a time",
                                                max_tokens=64, temperature=0)
                done.append(out.choices[0].finish_reason)
            except BaseException as exc:  # every request must complete
                errors.append(exc)
                return

    try:
        health = server.wait_healthy(1)
        assert len(health["replicas"]) == 1
        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        deadline, replicas = time.monotonic() + SCALE_UP_TIMEOUT_S, 1
        while time.monotonic() < deadline and not errors:
            health = server.health()
            replicas = sum(r["healthy"] for r in health["replicas"]) if health else replicas
            if replicas == 2:
                break
            time.sleep(1.0)
        scaled_after = len(done)
        if replicas == 2:  # the new replica serves: the load keeps completing (a few more answers)
            settle = time.monotonic() + 5.0
            while time.monotonic() < settle and len(done) < scaled_after + 6:
                time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(150)
        assert not errors, errors[:3]
        assert replicas == 2, f"still one replica after {SCALE_UP_TIMEOUT_S} s of load:\n{server.log()}"
        assert len(done) > scaled_after and set(done) == {"length"}
        assert all(not t.is_alive() for t in threads)
    finally:
        stop.set()
        code = server.stop()
    assert code == 0, server.log()
