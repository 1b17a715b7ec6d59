"""``pagoda serve MODEL --num-replicas N``: the application of ``app.py`` on a local Ray
instance (bound to 127.0.0.1) or on an existing cluster (``--ray-address``), Serve's HTTP proxy
at ``--host``/``--port``. Runs until SIGINT/SIGTERM, then removes the application (and stops
the Ray instance it started)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger("pagoda.ray")

APP_NAME = "pagoda"


def _check_locally(args: argparse.Namespace) -> None:
    """Refuse a bad model or engine option before any Ray process starts (local Ray only: on
    a cluster the model path is the workers' business)."""
    from pagoda.config import EngineArgs, EngineConfig

    EngineConfig.from_args(EngineArgs.from_namespace(args))


def start_ray(args: argparse.Namespace) -> bool:
    """Connect to ``--ray-address`` or start a local instance; True when we started it."""
    import ray

    if args.ray_address:
        ray.init(address=args.ray_address, logging_level=logging.WARNING)
        return False
    replicas = args.num_replicas or args.max_replicas or args.min_replicas or 1
    num_cpus = max(os.cpu_count() or 1, int(replicas * args.replica_num_cpus + 0.999))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING)
    return True


def run_ray_server(args: argparse.Namespace) -> int:
    try:
        from pagoda.entrypoints.ray.app import build_application
    except ImportError as exc:
        print(f"pagoda serve: error: scale-out flags need Ray Serve (pip install 'pagoda[ray]'): {exc}",
              file=sys.stderr)
        return 1
    try:
        application = build_application(args)
        if not args.ray_address:
            _check_locally(args)
    except (ValueError, OSError) as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 1
    import ray
    from ray import serve

    stop = threading.Event()
    started = start_ray(args)
    # After ray.init, which installs handlers of its own that would end the process before the
    # application is taken down.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as exc:  # a replica that cannot start: Serve gives up after its retries
            print(f"pagoda serve: error: the application failed to start: {exc}", file=sys.stderr)
            return 1
        logger.info("pagoda on Ray Serve: http://%s:%d (routing %s)", args.host, args.port, args.routing)
        print(f"pagoda serve: ready at http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        try:
            if started:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            if started:
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
