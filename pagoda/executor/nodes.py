"""One engine over several machines: the worker nodes' launcher and node 0's watch on them.

``--nnodes N`` spreads the engine's ranks evenly over N machines (``ParallelConfig.node_ranks``).
Node 0 runs the API server, the engine core (rank 0, the driver) and its other local ranks, as a
single-node engine does (``tp_executor.TPExecutor``). Every other node runs ``WorkerNode``: it
starts that node's worker ranks (``tp_worker``) and waits. All ranks meet in the store rank 0
hosts at ``--dist-init-addr HOST:PORT`` and form one group; the driver's control messages and
step inputs already travel over that group's broadcasts, so they reach other nodes unchanged.

Failure policy, beside the collectives' own timeouts:

- each worker node bumps a heartbeat counter in the store every ``HEARTBEAT_S``; node 0's
  ``NodeMonitor`` declares a node lost when its counter stands still for ``NODE_TIMEOUT_S``
  (env ``PAGODA_NODE_TIMEOUT_S``), so a machine that vanishes while the engine idles fails the
  engine too. A killed worker process is caught sooner: the next step's collective fails.
- a worker node exits when any of its ranks exits (0 only if all did after the driver's
  shutdown message), and when the store, that is node 0, stops answering.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import threading
import time

from pagoda.config import EngineConfig, split_host_port
from pagoda.distributed.rendezvous import is_loopback, pin_to_loopback
from pagoda.executor.tp_protocol import STEP_TIMEOUT_S, WorkerArgs, spawn_worker

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
NODE_TIMEOUT_S = float(os.environ.get("PAGODA_NODE_TIMEOUT_S", 30))
# How long ranks wait for the other nodes to reach the rendezvous (nodes start one by one).
NODE_WAIT_S = float(os.environ.get("PAGODA_NODE_WAIT_S", 600))
# After node 0 goes away, how long the worker ranks get to notice and exit by themselves.
EXIT_GRACE_S = 10.0
_POLL_S = 0.1


def rendezvous_method(config: EngineConfig) -> str | None:
    """``tcp://HOST:PORT`` of ``--dist-init-addr``, or None (a fresh loopback port is chosen)."""
    addr = config.parallel.dist_init_addr
    if not addr:
        return None
    host, port = split_host_port(addr)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def heartbeat_key(node: int) -> str:
    return f"pagoda/node/{node}/heartbeat"


def done_key(node: int) -> str:
    """Set by a worker node once all its ranks exited after the driver's shutdown message."""
    return f"pagoda/node/{node}/done"


def wait_nodes_done(store: object, nodes: range, timeout_s: float) -> bool:
    """Node 0's side of a clean shutdown: keep the store up until every worker node has seen
    its ranks exit (else their heartbeats would find it gone and report node 0 lost)."""
    try:
        store.wait([done_key(node) for node in nodes], datetime.timedelta(seconds=timeout_s))  # type: ignore
        return True
    except Exception as exc:
        logger.warning("not every worker node confirmed the shutdown: %s", exc)
        return False


class NodeMonitor:
    """Node 0's watch on the other nodes' heartbeats (a daemon thread reading the store)."""

    def __init__(self, store: object, nodes: range, timeout_s: float = NODE_TIMEOUT_S) -> None:
        self.store, self.nodes, self.timeout_s = store, nodes, timeout_s
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pagoda-node-monitor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        seen = {node: (-1, time.monotonic()) for node in self.nodes}
        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            for node in self.nodes:
                try:
                    beats = int(self.store.add(heartbeat_key(node), 0))  # type: ignore[attr-defined]
                except Exception as exc:  # the store lives in this process: it failing ends the watch
                    logger.debug("node monitor stopped: %s", exc)
                    return
                last, since = seen[node]
                if beats != last:
                    seen[node] = (beats, now)
                elif now - since > self.timeout_s:
                    self.lost = (f"worker node {node} sent no heartbeat for {now - since:.0f} s "
                                 f"(PAGODA_NODE_TIMEOUT_S={self.timeout_s:g}); the engine cannot continue")
                    return

    def stop(self) -> None:
        self._stop.set()


class WorkerNode:
    """``pagoda serve --nnodes N --node-rank K`` for K > 0: this node's ranks, no API, no
    scheduler. ``run`` returns the exit code: 0 once the driver has shut the engine down."""

    def __init__(self, config: EngineConfig) -> None:
        p = config.parallel
        if p.nnodes < 2 or p.node_rank == 0:
            raise ValueError("a worker node needs nnodes > 1 and node_rank > 0 (node 0 runs the engine itself)")
        self.config = config
        self.init_method = rendezvous_method(config)
        assert self.init_method is not None  # EngineConfig requires dist_init_addr with nnodes > 1
        self.host, self.port = split_host_port(p.dist_init_addr or "")
        self.procs: dict[int, subprocess.Popen] = {}
        self._node0_gone = threading.Event()
        self._done = threading.Event()
        self._stopping = False

    def run(self) -> int:
        p = self.config.parallel
        if is_loopback(self.host):
            pin_to_loopback()  # before spawning: workers inherit the environment
        backend = "nccl" if self.config.device.startswith("cuda") else "gloo"
        ranks = p.node_ranks()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for rank in ranks:
                args = WorkerArgs(self.config, rank, p.world_size, self.init_method, backend, STEP_TIMEOUT_S,
                                  os.getpid(), connect_timeout_s=NODE_WAIT_S)
                self.procs[rank] = spawn_worker(args)
            logger.info("worker node %d of %d: ranks %d..%d started, meeting node 0 at %s:%d", p.node_rank,
                        p.nnodes, ranks[0], ranks[-1], self.host, self.port)
            beat = threading.Thread(target=self._heartbeat, name="pagoda-node-heartbeat", daemon=True)
            beat.start()
            code = self._wait()
            if code == 0:
                self._done.set()  # the heartbeat thread tells node 0 and lets go of the store
                beat.join(5.0)
            return code
        finally:
            self._stop_workers(2.0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _heartbeat(self) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=NODE_WAIT_S),
                                  wait_for_workers=False)
            store.set_timeout(datetime.timedelta(seconds=NODE_TIMEOUT_S))
            node = self.config.parallel.node_rank
            while not self._done.wait(HEARTBEAT_S):
                store.add(heartbeat_key(node), 1)
            store.set(done_key(node), "1")
        except Exception as exc:
            logger.debug("heartbeat stopped: %s", exc)
            self._node0_gone.set()

    def _wait(self) -> int:
        """Until every rank has exited (0 if all exited cleanly), a rank fails, node 0 goes away
        or a signal asks this node to stop."""
        gone_since: float | None = None
        while True:
            codes = {rank: proc.poll() for rank, proc in self.procs.items()}
            failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
            if failed:
                rank, code = next(iter(failed.items()))
                logger.error("worker rank %d exited with code %d (node 0 gone, or the rank failed); "
                             "worker node %d exiting", rank, code, self.config.parallel.node_rank)
                return 1
            if all(code == 0 for code in codes.values()):
                logger.info("the engine shut down; worker node %d exiting", self.config.parallel.node_rank)
                return 0
            if self._stopping:
                logger.warning("worker node %d stopped by a signal: the engine on node 0 fails with it",
                               self.config.parallel.node_rank)
                return 1
            if self._node0_gone.is_set():
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > EXIT_GRACE_S:
                    logger.error("node 0 (%s:%d) stopped answering; worker node %d exiting", self.host, self.port,
                                 self.config.parallel.node_rank)
                    return 1
            time.sleep(_POLL_S)

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_worker_node(config: EngineConfig) -> int:
    return WorkerNode(config).run()
