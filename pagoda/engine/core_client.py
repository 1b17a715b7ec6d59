"""The API server's link to the engine-core process.

``EngineCoreClient`` starts the engine-core process (``engine/core_proc.py``), owns the two
ZMQ sockets (``ipc://`` in a private temp dir, removed as soon as the engine core has connected,
so a crash of either process leaves nothing behind) and turns replies into Python objects. The
errors below are what the server sees of the engine. ``AsyncEngine`` (``engine/async_engine.py``)
builds the HTTP handlers' view on top of this client.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagoda.config import EngineArgs
from pagoda.engine.messages import CoreInputMsg, CoreOutputMsg, EngineErrorMsg, ReadyMsg

logger = logging.getLogger(__name__)

# The socket folder's name holds the API server's pid, so a later start can tell a folder whose
# owner died before the engine core connected (the only moment one can be left) and remove it.
IPC_DIR_PREFIX = "pagoda-ipc-"
_IPC_DIR_NAME = re.compile(re.escape(IPC_DIR_PREFIX) + r"(\d+)-")


class EngineStartupError(RuntimeError):
    """The engine core could not be built (bad model directory, too little KV memory, ...)."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more can be served."""


class EngineOverloadedError(RuntimeError):
    """The request queue is full: the client should retry later (HTTP 429)."""


class RequestTimeoutError(RuntimeError):
    """The request's deadline (``--max-queue-time`` or its ``timeout``) passed before it started
    running: the client should retry later (HTTP 503 with ``Retry-After``)."""


class RequestFailedError(RuntimeError):
    """The engine ended one request because handling it failed (the engine goes on). The
    message is for the server log; the client gets a generic 500."""


def _engine_core_main(*args: Any) -> None:
    """The spawned process's target: imports the engine core's module (torch, the model code,
    Triton) in the child only. Naming ``run_engine_core`` itself as the target would import it here
    before the spawn, delaying the engine core's start by about 1.2 s; this process never runs
    the model code (torch it imports later, with its config and tokenizer)."""
    from pagoda.engine.core_proc import run_engine_core

    run_engine_core(*args)


class EngineCoreClient:
    """Starts the engine-core process and talks to it over ZMQ (msgpack frames, no pickle)."""

    def __init__(self, args: EngineArgs, log_level: str = "info") -> None:
        self.args = args
        self.log_level = log_level
        # mkdtemp makes the directory 0700: only this user can reach the sockets inside it.
        remove_stale_ipc_dirs()
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
        self.input_address = f"ipc://{os.path.join(self.ipc_dir, 'input')}"
        self.output_address = f"ipc://{os.path.join(self.ipc_dir, 'output')}"
        self.ctx = zmq.asyncio.Context()
        self.input = self._bind(zmq.PUSH, self.input_address)
        self.output = self._bind(zmq.PULL, self.output_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreOutputMsg)
        self.process: multiprocessing.process.BaseProcess | None = None
        # The engine core writes time.monotonic() here on every turn of its loop (steps and
        # idle polls alike): shared memory, so reading it never waits on a long step.
        self.progress = multiprocessing.get_context("spawn").Value("d", time.monotonic(), lock=False)
        self.ready: ReadyMsg | None = None
        self.error: str | None = None  # the engine's last words, if it sent any
        self._forget_files: asyncio.Future | None = None
        self._monitors: list[zmq.asyncio.Socket] = []  # from ``launch`` until ``start`` watches them

    def _bind(self, kind: int, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        return sock

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def seconds_since_progress(self) -> float:
        """How long ago the engine core's loop last turned (a step, or an idle poll)."""
        return max(0.0, time.monotonic() - self.progress.value)

    def launch(self) -> None:
        """Spawn the engine core (it loads the model from here on); ``start`` waits for it.
        Idempotent. Called early, so the model loads while this process sets up its front end."""
        if self.process is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        # Watched from before the engine core exists, so its connections cannot be missed.
        self._monitors = [sock.get_monitor_socket(zmq.EVENT_ACCEPTED) for sock in (self.input, self.output)]
        self.process = ctx.Process(target=_engine_core_main, name="pagoda-engine-core",
                                   args=(self.args, self.input_address, self.output_address, os.getpid(),
                                         self.log_level, self.progress))
        # The engine core inherits this process's OpenMP setting (pagoda's short spin unless the
        # user chose): beside the mostly idle API process, sleeping at once between parallel
        # regions cost 1.2-1.4x in time per output token at batch 1 (docs/benchmarks.md).
        self.process.start()

    def abandon(self, timeout: float = 5.0) -> None:
        """Stop a launched engine core without an event loop (a start-up that failed before
        ``start``): as ``shutdown``, waiting on this thread."""
        self._stop_process(timeout)
        self._close()

    async def start(self) -> ReadyMsg:
        """Spawn the engine core unless ``launch`` did, and wait for its ready message (no time
        limit: a large model may take minutes to load). Raises ``EngineStartupError`` with the
        engine's reason."""
        self.launch()
        monitors, self._monitors = self._monitors, []
        self._forget_files = asyncio.ensure_future(self._remove_ipc_dir_when_connected(monitors))
        while True:
            if await self.output.poll(500):
                msg = self.decoder.decode(await self.output.recv())
                if isinstance(msg, ReadyMsg):
                    self.ready = msg
                    return msg
                if isinstance(msg, EngineErrorMsg):
                    self.process.join(5)
                    raise EngineStartupError(msg.message)
            elif not self.process.is_alive():
                raise EngineStartupError(f"the engine core process exited with code {self.process.exitcode} "
                                         "during start-up (see its log above)")

    async def _remove_ipc_dir_when_connected(self, monitors: list[zmq.asyncio.Socket]) -> None:
        """Remove the socket files once the engine core holds both connections: a connected Unix
        socket needs no file, and the engine core never reconnects (either side's death ends
        the server), so from then on a crash (even SIGKILL) leaves nothing in the temp folder."""
        try:
            for monitor in monitors:
                await monitor.recv_multipart()  # EVENT_ACCEPTED: the engine core connected
        finally:
            for sock, monitor in zip((self.input, self.output), monitors):
                sock.disable_monitor()
                monitor.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        logger.debug("engine core connected; removed %s", self.ipc_dir)

    async def send(self, msg: CoreInputMsg) -> None:
        await self.input.send(self.encoder.encode(msg), copy=False)

    async def recv(self) -> CoreOutputMsg:
        frame = await self.output.recv(copy=False)
        msg = self.decoder.decode(frame.buffer)
        if isinstance(msg, EngineErrorMsg):
            self.error = msg.message
        return msg

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL after ``timeout``) and clean up."""
        await asyncio.to_thread(self._stop_process, timeout)
        if self._forget_files is not None:  # still waiting for a connection: stop watching
            self._forget_files.cancel()
            await asyncio.gather(self._forget_files, return_exceptions=True)
        self._close()
        logger.info("engine core stopped")

    def _stop_process(self, timeout: float) -> None:
        """SIGTERM the engine core, SIGKILL it if it is still alive ``timeout`` seconds later."""
        proc = self.process
        if proc is None or not proc.is_alive():
            return
        logger.info("stopping the engine core (pid %d)", proc.pid)
        proc.terminate()
        proc.join(timeout)
        if proc.is_alive():
            logger.warning("engine core did not stop within %.0f s; killing it", timeout)
            proc.kill()
            proc.join(timeout)

    def _close(self) -> None:
        """Close the sockets (and monitors of a launch never started) and remove their folder."""
        for monitor in self._monitors:
            monitor.close(linger=0)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove this user's socket folders in ``root`` (the temp folder) whose API server is dead:
    what a crash between making one and the engine core connecting leaves. Returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _IPC_DIR_NAME.match(entry.name)
        try:
            if (not match or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid()):
                continue
        except OSError:
            continue
        if not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's live process, or an absurd pid: keep it
        return True
    return True
