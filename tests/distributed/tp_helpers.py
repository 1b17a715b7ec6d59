"""Which processes a test has started, read from /proc (the tests run on Linux)."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path


def child_pids(parent: int | None = None) -> set[int]:
    """Live (non-zombie) children of ``parent`` (default: this process), from /proc."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if fields[0] != "Z" and int(fields[1]) == parent and not _is_resource_tracker(entry):
            found.add(int(entry.name))
    return found


def _is_resource_tracker(entry: Path) -> bool:
    """Python's multiprocessing resource tracker: started by the first ``spawn`` process of the
    test session (e.g. ``pagoda bench stress wrong-key``'s attacker) and kept until it ends; it
    is not a worker of any engine."""
    try:
        return b"multiprocessing.resource_tracker" in (entry / "cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int] | list[int], timeout_s: float) -> set[int]:
    """Wait until none of ``pids`` is alive; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
