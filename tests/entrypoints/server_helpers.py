"""Running ``pagoda serve`` as a real subprocess on a free loopback port."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

# Small enough for a CPU box, big enough that every test prompt fits.
SERVER_ENGINE_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 180.0


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port no other server of this test session got. The kernel may hand the same
    free port to two calls in a row, and a server binds it only later (SO_REUSEADDR lets two
    not-yet-listening sockets share it): two servers started side by side could share a port."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *args]


def _device_args() -> tuple[str, ...]:
    """Where a test server's engine runs: on the CPU, as the in-process engines of the suite do
    on a machine with CUDA (``tests/conftest.py``), so that a server's greedy outputs can be
    compared with an offline engine's; ``PAGODA_TEST_DEVICE=auto`` lets both take the GPU."""
    import torch

    if os.environ.get("PAGODA_TEST_DEVICE") == "auto" or not torch.cuda.is_available():
        return ()
    return ("--device", "cpu")


class ServerProcess:
    """One ``pagoda serve`` subprocess; its output goes to a log file shown on failure."""

    def __init__(self, model_dir: Path, log_dir: Path, *extra: str, drop_env: tuple[str, ...] = (),
                 set_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = serve_command(str(model_dir), "--port", str(self.port), *SERVER_ENGINE_ARGS, *_device_args(), *extra)
        env = {k: v for k, v in os.environ.items() if k not in drop_env}
        env["TOKENIZERS_PARALLELISM"] = "false"
        env.update(set_env or {})
        self.env = env
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def side_by_side(servers: dict[str, ServerProcess],
                 shared: tuple[ServerProcess, ...] = ()) -> Iterator[dict[str, ServerProcess]]:
    """Servers already started together (so their start-ups overlap): wait until all are
    ready, and stop every one of them afterwards, whatever happens. ``shared``: session servers
    (started, perhaps not yet ready) also waited for here, and left running."""
    try:
        for srv in (*servers.values(), *shared):
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def start_server(model_dir: Path, log_dir: Path, *extra: str) -> ServerProcess:
    server = ServerProcess(model_dir, log_dir, *extra)
    server.wait_ready()
    return server


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Pause a process (SIGSTOP) for the duration: a paused engine core keeps requests in
    flight for as long as a test needs, however fast the machine is."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def engine_pid(base_url: str) -> int:
    return httpx.get(base_url + "/health", timeout=30).json()["engine_pid"]
