"""``pagoda serve`` on a machine other than node 0 of a multi-node engine: no API server, no
scheduler, only this node's worker ranks (``executor.nodes.WorkerNode``)."""
from __future__ import annotations

import argparse
import sys

from pagoda.config import EngineArgs, EngineConfig, check_nodes


def check_multinode_args(args: argparse.Namespace) -> int | None:
    """Run a worker node (``--node-rank`` > 0) to its end and return its exit code; on node 0
    return None (the server starts as usual) unless the multi-node flags are wrong (1)."""
    from pagoda.entrypoints.ray.args import uses_ray

    prog = "pagoda serve"
    if uses_ray(args):
        print(f"{prog}: error: --nnodes/--node-rank cannot be combined with Ray replicas", file=sys.stderr)
        return 1
    engine_args = EngineArgs.from_namespace(args)
    try:
        if check_nodes(engine_args)["node_rank"] == 0:
            return None  # node 0: the server and engine as usual; the engine core checks the rest
        config = EngineConfig.from_args(engine_args)
    except (ValueError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    from pagoda.executor.nodes import run_worker_node

    return run_worker_node(config)
