"""``pagoda serve MODEL --num-replicas N``: the application of ``app.py`` on a local Ray
instance (bound to 127.0.0.1) or on an existing cluster (``--ray-address``), Serve's HTTP proxy
at ``--host``/``--port``. Runs until SIGINT/SIGTERM, then removes the application (and stops
the Ray instance it started)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

logger = logging.getLogger("pagoda.ray")

APP_NAME = "pagoda"

# Ray Serve settings for the Ray instance ``pagoda serve`` starts itself (a cluster of one's
# own sets them in its nodes' environment; deploy/kuberay does): the request path logs in
# batches, Serve's own metrics are exported once a second instead of ten times and its
# controller loop runs twice a second instead of ten times (an idle one-replica deployment
# otherwise burns about a tenth of a core, taken from the engine on a small machine). An explicit
# value in the environment wins.
SERVE_ENV = {
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


def _check_locally(args: argparse.Namespace) -> None:
    """Refuse a bad model or engine option before any Ray process starts (local Ray only: on
    a cluster the model path is the workers' business)."""
    from pagoda.config import EngineArgs, EngineConfig

    EngineConfig.from_args(EngineArgs.from_namespace(args))


@contextlib.contextmanager
def _in_package_parent() -> Iterator[None]:
    """Run ``ray.init`` from the folder that holds this ``pagoda`` package. Ray puts the
    driver's working directory first on every worker's ``sys.path`` (and starts local workers
    in it): from a folder holding another ``pagoda`` (a checkout, a data folder) the replicas
    imported that one and failed. From here they import the package the driver runs;
    ``EngineReplica`` moves back to the user's folder (``args.replica_cwd``) for relative paths."""
    import pagoda

    before = os.getcwd()
    os.chdir(Path(pagoda.__file__).resolve().parent.parent)
    try:
        yield
    finally:
        os.chdir(before)


def start_ray(args: argparse.Namespace) -> bool:
    """Connect to ``--ray-address`` or start a local instance; True when we started it."""
    import ray

    if args.ray_address and args.ray_address != "local":
        with _in_package_parent():
            ray.init(address=args.ray_address, logging_level=logging.WARNING)
        return False
    for name, value in SERVE_ENV.items():  # before ray.init: Ray's processes inherit them
        os.environ.setdefault(name, value)
    replicas = args.num_replicas or args.max_replicas or args.min_replicas or 1
    num_cpus = max(os.cpu_count() or 1, int(replicas * args.replica_num_cpus + 0.999))
    with _in_package_parent():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING)
    return True


def run_ray_server(args: argparse.Namespace) -> int:
    """``pagoda serve`` as replicas on Ray Serve (the CLI chose it: ``args.uses_ray``); returns
    the process exit code."""
    if getattr(args, "allow_runtime_lora_updating", False):  # one replica's load would not reach the others
        print("pagoda serve: error: --allow-runtime-lora-updating is not supported with Ray replicas; "
              "give the adapters with --lora-modules", file=sys.stderr)
        return 1
    try:
        from pagoda.entrypoints.ray.app import build_application
    except ImportError as exc:
        print(f"pagoda serve: error: scale-out flags need Ray Serve (pip install 'pagoda[ray]'): {exc}",
              file=sys.stderr)
        return 1
    local = not args.ray_address or args.ray_address == "local"
    # Relative paths in the flags mean the user's folder, also in the replicas (local Ray only:
    # a cluster's nodes have folders of their own).
    args.replica_cwd = os.getcwd() if local else None
    try:
        application = build_application(args)
        if local:
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
        # No access log: the single server keeps none either (one line per request is CPU on
        # the request path).
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"enable_access_log": False})
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
