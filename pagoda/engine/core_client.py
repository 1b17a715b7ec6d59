"""The API server's link to the engine-core process.

``EngineCoreClient`` starts the engine-core process (``engine/core_proc.py``), owns the two
ZMQ sockets (``ipc://`` in a private temp dir) and turns replies into Python objects. The
errors below are what the server sees of the engine. ``AsyncEngine`` (``engine/async_engine.py``)
builds the HTTP handlers' view on top of this client.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from pagoda.config import EngineArgs
from pagoda.engine.core_proc import run_engine_core
from pagoda.engine.messages import CoreInputMsg, CoreOutputMsg, EngineErrorMsg, ReadyMsg

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core could not be built (bad model directory, too little KV memory, ...)."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more can be served."""


class EngineOverloadedError(RuntimeError):
    """The request queue is full: the client should retry later (HTTP 429)."""


class RequestFailedError(RuntimeError):
    """The engine ended one request because handling it failed (the engine goes on). The
    message is for the server log; the client gets a generic 500."""


class EngineCoreClient:
    """Starts the engine-core process and talks to it over ZMQ (msgpack frames, no pickle)."""

    def __init__(self, args: EngineArgs, log_level: str = "info") -> None:
        self.args = args
        self.log_level = log_level
        # mkdtemp makes the directory 0700: only this user can reach the sockets inside it.
        self.ipc_dir = tempfile.mkdtemp(prefix="pagoda-ipc-")
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

    async def start(self) -> ReadyMsg:
        """Spawn the engine core and wait for its ready message (no time limit: a large model
        may take minutes to load). Raises ``EngineStartupError`` with the engine's reason."""
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_engine_core, name="pagoda-engine-core",
                                   args=(self.args, self.input_address, self.output_address, os.getpid(),
                                         self.log_level, self.progress))
        # The engine core inherits this process's OpenMP setting (pagoda's short spin unless the
        # user chose): beside the mostly idle API process, sleeping at once between parallel
        # regions cost 1.2-1.4x in time per output token at batch 1 (docs/benchmarks.md).
        self.process.start()
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
        proc = self.process
        if proc is not None and proc.is_alive():
            logger.info("stopping the engine core (pid %d)", proc.pid)
            proc.terminate()
            await asyncio.to_thread(proc.join, timeout)
            if proc.is_alive():
                logger.warning("engine core did not stop within %.0f s; killing it", timeout)
                proc.kill()
                await asyncio.to_thread(proc.join, timeout)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        logger.info("engine core stopped")
