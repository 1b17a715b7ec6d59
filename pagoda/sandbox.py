"""Run untrusted work in worker processes, with a wall-clock timeout and a memory limit.

Some work takes input from a client and runs native code on it that can crash (a stack overflow
in a grammar compiler), run for minutes or allocate without bound. A ``Sandbox`` runs such work
in a small persistent pool of worker processes (``python -m pagoda.sandbox``), so the worst a
request can do is lose its own worker:

* a worker that dies (a signal, a native abort) is reported as ``SandboxCrash``;
* a call that runs past its timeout kills its worker and raises ``SandboxTimeout``;
* a worker's address space is capped (``RLIMIT_AS`` = its size once initialised + the memory
  budget), so allocating past it raises ``SandboxMemoryError``, or kills the worker (a crash);
  workers keep one malloc arena (``MALLOC_ARENA_MAX=1``): each call's new thread would otherwise
  reserve an arena of its own (64 MiB of address space) whenever its predecessor had not yet
  exited, spending the call's budget on nothing;
* each call runs on a thread with a stack of ``stack_mib`` (deep recursion in native code is
  refused here at a depth the caller can afford with its own, larger, stacks);
* workers run calls at a lower CPU priority (``nice``), so the server's own work goes first
  when a hostile input keeps a worker busy until its timeout.

A lost worker is replaced (started again) on the next call; the pool stays usable. Workers are
started on first use, run ``init(*init_args)`` once (e.g. load a tokenizer) and then
``fn(state, *args)`` per call. Calls travel to the worker pickled (trusted: the caller's own
functions and arguments); results come back as JSON only, so a worker subverted by its input
cannot hand the caller anything but plain data. ``call`` blocks (an asyncio caller runs it in an
executor thread: the waiting thread holds no lock and no GIL).
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MIB = 1024
DEFAULT_STACK_MIB = 4
DEFAULT_NICE = 10
START_TIMEOUT_S = 180.0  # python start-up plus ``init`` (loading a tokenizer) on a busy machine


class SandboxError(RuntimeError):
    """The sandboxed call did not complete; the message says why, in words for a client."""


class SandboxCrash(SandboxError):
    pass


class SandboxTimeout(SandboxError):
    pass


class SandboxMemoryError(SandboxError):
    pass


class SandboxBusy(SandboxError):
    """Every worker stayed busy for the whole wait: the caller should retry later."""


class _Worker:
    """One worker process and its end of a socket pair."""

    def __init__(self, init: tuple[Callable[..., Any], tuple], memory_mib: int, stack_mib: int, nice: int) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["MALLOC_ARENA_MAX"] = "1"  # the budget is the call's, not per-thread arenas' (module notes)
        self.proc = subprocess.Popen([sys.executable, "-m", "pagoda.sandbox", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send_bytes(pickle.dumps((init, memory_mib, stack_mib, nice)))
        self.ready = False
        self.start_error: SandboxError | None = None

    def request(self, payload: bytes, timeout: float) -> Any:
        """Send ``payload`` and wait up to ``timeout`` seconds for the JSON reply."""
        self._wait_started(START_TIMEOUT_S)  # the start-up reply comes first; its time is not the call's
        self.conn.send_bytes(payload)
        return self._receive(timeout, "running")

    def started(self) -> bool:
        """Whether start-up is over and went well (without waiting for it)."""
        if not self.ready and self.start_error is None and self.conn.poll(0):
            try:
                self._wait_started(0)
            except SandboxError:
                pass
        return self.ready

    def _wait_started(self, timeout: float) -> None:
        if self.start_error is not None:
            raise self.start_error
        if not self.ready:
            try:
                self._receive(timeout, "starting")
            except SandboxError as exc:
                self.start_error = exc
                raise
            self.ready = True

    def _receive(self, timeout: float, what: str) -> Any:
        try:
            if not self.conn.poll(timeout):
                self.kill()
                raise SandboxTimeout(f"took longer than {timeout:g} s")
            reply = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise SandboxCrash(self._death()) from exc
        if "error" in reply:
            if reply["error"] == "MemoryError":
                raise SandboxMemoryError("ran out of its memory limit")
            raise SandboxError(f"failed while {what}: {reply['error']}: {reply['message']}")
        return reply["ok"]

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "stopped answering"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            hint = " (out of memory?)" if name in ("SIGABRT", "SIGKILL") else ""
            return f"crashed ({name}){hint}"
        return f"exited with status {code}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class Sandbox:
    """A pool of ``workers`` processes for untrusted calls (see the module docstring)."""

    def __init__(self, init: Callable[..., Any], init_args: tuple = (), *, workers: int = 1,
                 timeout: float = DEFAULT_TIMEOUT_S, memory_mib: int = DEFAULT_MEMORY_MIB,
                 stack_mib: int = DEFAULT_STACK_MIB, nice: int = DEFAULT_NICE) -> None:
        self.init = (init, init_args)
        self.nice = nice
        self.timeout, self.memory_mib, self.stack_mib = timeout, memory_mib, stack_mib
        self.num_workers = workers
        # Idle slots: a worker, or None for one not started yet (started on first use).
        self._idle: list[_Worker | None] = [None] * workers
        self._idle_changed = threading.Condition()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self.restarts = 0  # workers replaced after a crash or timeout
        self._closed = False

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
             wait: float | None = None) -> Any:
        """``fn(state, *args)`` in a worker; its JSON-able result. Raises a ``SandboxError``
        (crash, timeout, memory, ``SandboxBusy`` when no worker frees up within ``wait``
        seconds, by default the call's timeout); the pool stays usable."""
        timeout = self.timeout if timeout is None else timeout
        if self._closed:
            raise SandboxError("the sandbox is shut down")
        worker = self._take(timeout if wait is None else wait)
        try:
            if worker is None or not worker.alive():
                worker = self._start(worker)
            return worker.request(pickle.dumps((fn, args)), timeout)
        except SandboxError as exc:
            # A worker that crashed, timed out or could not start is replaced at once (its
            # successor starts up while nobody waits); one whose call raised (out of memory
            # included: Python freed it) serves on.
            if worker is not None and not worker.ready:
                self._discard(worker)
                worker = None
            elif worker is not None and isinstance(exc, (SandboxCrash, SandboxTimeout)):
                worker = None if self._closed else self._start(worker)
            raise
        finally:
            self._give_back(worker)

    def _take(self, wait: float) -> _Worker | None:
        """An idle slot, preferring a worker that is already started up (one that replaces a
        crashed worker may still be loading); ``SandboxBusy`` after ``wait`` seconds."""
        with self._idle_changed:
            if not self._idle_changed.wait_for(lambda: self._idle, timeout=wait):
                raise SandboxBusy("every sandbox worker is busy")
            ready = [i for i, w in enumerate(self._idle) if w is not None and w.alive() and w.started()]
            return self._idle.pop(ready[0] if ready else 0)

    def _give_back(self, worker: _Worker | None) -> None:
        with self._idle_changed:
            self._idle.append(worker)
            self._idle_changed.notify()

    def start(self) -> None:
        """Start every idle worker now (they initialise in the background), so that the first
        calls do not wait for start-up."""
        with self._idle_changed:
            if not self._closed:
                self._idle = [w if w is not None else self._start(None) for w in self._idle]

    def _start(self, dead: _Worker | None) -> _Worker:
        if dead is not None:
            self._discard(dead)
        worker = _Worker(self.init, self.memory_mib, self.stack_mib, self.nice)
        with self._lock:
            self._all.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.discard(worker)
                self.restarts += 1

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all if w.alive()]

    def shutdown(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


# ---- the worker side ---------------------------------------------------------------------------

def _limit_memory(budget_mib: int) -> None:
    """Cap the address space at its current size plus ``budget_mib`` (what the libraries
    loaded so far already map is not the call's to spend)."""
    import resource

    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + (budget_mib << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _on_thread(fn: Callable[[], Any], stack_mib: int) -> Any:
    """``fn()`` on a fresh thread with a ``stack_mib`` stack; its result or its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["ok"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            out["exc"] = exc

    threading.stack_size(stack_mib << 20)
    thread = threading.Thread(target=run, name="pagoda-sandbox-call")
    thread.start()
    threading.stack_size(0)
    thread.join()
    if "exc" in out:
        raise out["exc"]
    return out.get("ok")


def _reply(conn: Connection, thunk: Callable[[], Any]) -> bool:
    """Send ``thunk()``'s result, or its exception's name and text; whether it succeeded."""
    ok = False
    try:
        data = json.dumps({"ok": thunk()})
        ok = True
    except MemoryError:
        data = json.dumps({"error": "MemoryError", "message": ""})
    except Exception as exc:
        data = json.dumps({"error": type(exc).__name__, "message": str(exc)[:2000]})
    conn.send_bytes(data.encode())
    return ok


def worker_main(fd: int) -> None:
    """The worker's loop: initialise, then answer calls until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    conn = Connection(fd)
    setup = conn.recv_bytes()
    state: dict[str, Any] = {}

    def initialise() -> str:
        (init_fn, init_args), memory_mib, state["stack_mib"], nice = pickle.loads(setup)
        state["value"] = init_fn(*init_args)
        _limit_memory(memory_mib)
        os.nice(nice)  # after start-up (trusted, and a waiting caller may need it soon)
        return "ready"

    if not _reply(conn, initialise):
        return
    while True:
        try:
            fn, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        _reply(conn, lambda: _on_thread(lambda: fn(state["value"], *args), state["stack_mib"]))


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
