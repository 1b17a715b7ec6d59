"""The engine-core process of the server: ``EngineCore`` in a busy loop behind two ZMQ sockets.

The API server process owns the sockets (it binds them in a private temp dir) and starts this
process with the ``spawn`` context. Here there is no asyncio and no HTTP: the loop takes new
requests, aborts and utility calls off the input socket (without waiting while there is work,
blocking while idle), runs one ``step()`` and pushes the ``EngineCoreOutputs`` back. Every
frame is one msgpack-encoded ``CoreInputMsg`` / ``CoreOutputMsg`` (``engine/messages.py``).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from types import FrameType
from typing import Any

import msgspec
import zmq

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine import gc_freeze
from pagoda.engine.core import EngineCore
from pagoda.process_exit import exit_without_teardown
from pagoda.engine.snapshot import engine_snapshot
from pagoda.lora.request import LoRARequest
from pagoda.engine.messages import (AbortMsg, AddRequestMsg, CoreInputMsg, CoreOutputMsg, EngineCoreOutput,
                                    EngineCoreOutputs, EngineErrorMsg, OutputsMsg, ReadyMsg, RequestError, UtilityMsg,
                                    UtilityResultMsg)

logger = logging.getLogger(__name__)

# While idle the loop blocks on the input socket, waking this often to check that the API
# server (its parent) is still alive, so an orphaned engine exits by itself.
IDLE_POLL_MS = 500
# How long a final message (an error) may wait for the server to take it before we exit.
SOCKET_LINGER_MS = 1000


class TerminateEngine(BaseException):
    """Raised by the SIGTERM handler; a BaseException so no ``except Exception`` swallows it."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise TerminateEngine()


def _setup_process(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [engine-core pid={os.getpid()}] %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group; the API server decides when the
    # engine stops (after in-flight requests drain), so the engine ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)


def _connect(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, SOCKET_LINGER_MS)
    # No high-water mark: a burst of requests must queue, not block or drop.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


def run_engine_core(args: EngineArgs, input_address: str, output_address: str, parent_pid: int,
                    log_level: str = "info", progress: Any = None) -> None:
    """Entry point of the engine-core process (the ``spawn`` target). Exits non-zero on failure."""
    _setup_process(log_level)
    ctx = zmq.Context()
    inp = _connect(ctx, zmq.PULL, input_address)
    out = _connect(ctx, zmq.PUSH, output_address)
    encoder = msgspec.msgpack.Encoder()
    code = 1
    try:
        config = None
        try:
            config = EngineConfig.from_args(args)
            core = EngineCore(config)
        except TerminateEngine:
            code = 0
            return
        except Exception as exc:  # anything a bad model dir or config raises goes back to the server
            if config is None and isinstance(exc, (ValueError, OSError)):  # a refused option, a missing model:
                logger.error("engine core start-up failed: %s", exc)     # the message says it all
            else:
                logger.error("engine core start-up failed:\n%s", traceback.format_exc())
            out.send(encoder.encode(EngineErrorMsg(f"{type(exc).__name__}: {exc}")))
            return
        gc_freeze.freeze()  # this process holds one engine until it exits (gc_freeze.py)
        code = EngineCoreProc(core, inp, out, parent_pid, progress).run()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
        exit_without_teardown(code)


class EngineCoreProc:
    """The busy loop around one ``EngineCore``."""

    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket, parent_pid: int,
                 progress: Any = None) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        # A shared double (``multiprocessing.Value``) the server's /health reads: the loop
        # stamps it on every turn, so a long step is "busy", and only a stuck loop is "wedged".
        self.progress = progress
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreInputMsg)
        self.result_check = msgspec.msgpack.Decoder(UtilityResultMsg)
        # Outputs and errors produced between steps (aborts, rejected requests), sent in a batch.
        self._pending: list[EngineCoreOutput] = []
        self._errors: list[RequestError] = []
        # Messages read off the input socket during a step (``interactive_arrived``), handled
        # in order before any still on the socket.
        self._early: list[CoreInputMsg] = []

    def run(self) -> int:
        """Serve until SIGTERM (returns 0), the parent dies (0) or the engine fails (1)."""
        self._send(ReadyMsg(os.getpid(), self.core.kv.num_blocks, self.core.config.cache.block_size,
                            self.core.config.model.max_model_len))
        # A request or an abort that arrives mid-round ends the round at the next step.
        self.core.interrupt_rounds_when(self.input_waiting)
        # A step of batch rows only is given up between layers for an interactive request.
        self.core.abandon_background_when(self.interactive_arrived)
        try:
            while os.getppid() == self.parent_pid:
                self._stamp_progress()
                held = self.core.background_held_for()  # batch work held off: wait for input meanwhile
                self._receive(block=held > 0 or not self.core.has_unfinished(), timeout_ms=held * 1e3)
                self.core.check_health()
                if self.core.has_unfinished():
                    self._send(OutputsMsg(self.core.step()))
            logger.warning("the API server (pid %d) is gone; engine core exiting", self.parent_pid)
            return 0
        except TerminateEngine:
            logger.info("engine core terminated")
            return 0
        except Exception as exc:
            logger.error("engine core failed:\n%s", traceback.format_exc())
            self._send(EngineErrorMsg(f"engine core failed: {type(exc).__name__}: {exc}"))
            return 1
        finally:
            self.core.interrupt_rounds_when(None)
            self.core.abandon_background_when(None)
            self.core.shutdown()

    def input_waiting(self) -> bool:
        """Whether a message from the front end waits on the input socket (about 3 us), or was
        read off it during the step."""
        return bool(self._early) or bool(self.inp.poll(0, zmq.POLLIN))

    def interactive_arrived(self) -> bool:
        """Whether a request that is not background (the Batch API's lines are) came in since
        the step began: the messages waiting on the input socket are read and kept, in order,
        for ``_receive`` (a few microseconds when none waits)."""
        if self.inp.poll(0, zmq.POLLIN):
            self._read_input(self._early)
        return any(isinstance(m, AddRequestMsg) and not m.request.background for m in self._early)

    def _stamp_progress(self) -> None:
        if self.progress is not None:
            self.progress.value = time.monotonic()

    def _send(self, msg: CoreOutputMsg) -> None:
        self.out.send(self.encoder.encode(msg), copy=False)

    # ---- input -----------------------------------------------------------------------------
    def _receive(self, block: bool, timeout_ms: float = 0.0) -> None:
        """Handle every message waiting on the input socket; wait for one first if ``block``
        (for ``timeout_ms``, or ``IDLE_POLL_MS`` if 0)."""
        messages, self._early = self._early, []
        if block and not messages and not self.inp.poll(max(1, round(timeout_ms)) if timeout_ms else IDLE_POLL_MS):
            return
        self._read_input(messages)
        for msg in messages:
            self._handle(msg)
        self._errors.extend(self.core.take_errors())  # requests failed between steps
        if self._pending or self._errors:
            outs = EngineCoreOutputs(self._pending, self.core.stats(), time.time(), self._errors)
            self._pending, self._errors = [], []
            self._send(OutputsMsg(outs))

    def _read_input(self, into: list[CoreInputMsg]) -> None:
        """Append every message waiting on the input socket to ``into``, without waiting."""
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                into.append(self.decoder.decode(frame.buffer))
            except msgspec.MsgspecError:  # not a message we can read, so no request to answer
                logger.exception("dropped an undecodable input frame of %d bytes", len(frame.buffer))

    def _handle(self, msg: CoreInputMsg) -> None:
        if isinstance(msg, AddRequestMsg):
            # Whatever building one request raises refuses that request only: a ValueError is
            # the request's fault (400), anything else a failure of ours (500, logged here).
            request_id = msg.request.request_id
            try:
                self.core.add_request(msg.request)
            except ValueError as exc:
                self._errors.append(RequestError(request_id, str(exc), 400))
            except Exception as exc:
                logger.exception("request %s could not be added", request_id)
                self._errors.append(RequestError(request_id, f"{type(exc).__name__}: {exc}", 500))
        elif isinstance(msg, AbortMsg):
            for abort in msg.aborts:
                self._pending.extend(self.core.abort(abort))
        else:
            self._send(self._utility(msg))

    def _utility(self, msg: UtilityMsg) -> UtilityResultMsg:
        try:
            result = UtilityResultMsg(msg.call_id, self._call(msg.method, msg.args))
            # Decode it here as the front end will: a value outside the wire type fails this call
            # alone, instead of the front end's output loop (which would mark the engine dead).
            self.result_check.decode(self.encoder.encode(result))
            return result
        except Exception as exc:  # a failed utility call is reported, it does not stop the engine
            return UtilityResultMsg(msg.call_id, None, f"{type(exc).__name__}: {exc}")

    def _call(self, method: str, args: list) -> Any:
        if method == "ping":
            return "pong"
        if method == "stats":
            stats: dict[str, Any] = msgspec.structs.asdict(self.core.stats())
            kv = self.core.kv
            stats.update(num_blocks=kv.num_blocks, num_used_blocks=kv.num_used_blocks,
                         num_free_blocks=kv.num_free_blocks, pid=os.getpid())
            return stats
        if method == "snapshot":  # the dashboard's view (engine/snapshot.py), built only when asked
            return engine_snapshot(self.core)
        if method == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        if method == "sleep":  # args: level; returns the bytes released
            return self.core.sleep(int(args[0]))
        if method == "wake_up":
            self.core.wake_up()
            return None
        if method == "is_sleeping":  # the level slept at (0: awake)
            return self.core.sleeping
        if method == "update_weights":  # args: checkpoint directory
            self.core.update_weights(str(args[0]))
            return None
        if method == "add_lora":  # args: name, id, path
            self.core.add_lora(LoRARequest(str(args[0]), int(args[1]), str(args[2])))
            return None
        if method == "remove_lora":  # args: id
            return int(self.core.remove_lora(int(args[0])))
        raise ValueError(f"unknown utility method {method!r}")
