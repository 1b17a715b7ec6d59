"""The API server's side of the engine: the engine-core process and the async front end.

``EngineCoreClient`` starts the engine-core process (``engine/core_proc.py``), owns the two
ZMQ sockets (``ipc://`` in a private temp dir) and turns replies into Python objects.
``AsyncEngine`` is what the HTTP handlers use: it tokenizes, sends ``EngineCoreRequest``s, and
runs the one output-handler task that folds engine outputs into request states (incremental
detokenization, stop strings) and wakes the handler waiting on each request.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

import msgspec
import zmq
import zmq.asyncio

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.core_proc import run_engine_core
from pagoda.engine.input_processor import InputProcessor, load_tokenizer
from pagoda.engine.messages import (AbortMsg, AbortRequest, AddRequestMsg, CoreInputMsg, CoreOutputMsg,
                                    EngineCoreOutputs, EngineCoreRequest, EngineErrorMsg, OutputsMsg, ReadyMsg,
                                    SchedulerStats, UtilityMsg, UtilityResultMsg)
from pagoda.engine.output_processor import IterationStats, OutputProcessor, RequestState
from pagoda.omp import passive_children
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often the watchdog checks that the engine-core process is alive.
WATCHDOG_INTERVAL_S = 0.2
# Texts longer than this are tokenized in a worker thread so the event loop keeps serving
# streams meanwhile; short ones are cheaper to do inline than to hand off.
LARGE_TEXT_CHARS = 4096
# /health reports the engine as wedged when its loop has not turned for this long. A step on a
# long prompt or a first-time kernel compile can take many seconds; only a stuck loop takes this.
DEFAULT_STALL_TIMEOUT_S = 300.0


class EngineStartupError(RuntimeError):
    """The engine core could not be built (bad model directory, too little KV memory, ...)."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more can be served."""


class EngineOverloadedError(RuntimeError):
    """The request queue is full: the client should retry later (HTTP 429)."""


class RequestFailedError(RuntimeError):
    """The engine ended one request because handling it failed (the engine goes on). The
    message is for the server log; the client gets a generic 500."""


def _encode(processor: InputProcessor, text: str, add_special_tokens: bool) -> list[int]:
    return processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)


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
        with passive_children():  # the engine shares the cores with this API process
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


class StatsListener(Protocol):
    """Receives what metrics are made of (the server's Prometheus metrics, its log line)."""

    def on_engine_stats(self, stats: SchedulerStats) -> None: ...

    def on_iteration(self, iteration: IterationStats) -> None: ...

    def on_request_finished(self, state: RequestState) -> None: ...

    def on_request_aborted(self, num_requests: int) -> None: ...


@dataclass
class PromptInput:
    """One prompt of an API call, tokenized, with the sampling parameters it runs with."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class _Handle:
    """One engine request as the front end tracks it."""

    index: int
    state: RequestState
    group: "RequestGroup"
    error: BaseException | None = None

    def wake(self) -> None:
        self.group.wake(self.index)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake()


@dataclass
class RequestGroup:
    """The engine requests of one API call (one per prompt), read as one stream of changes.

    The output handler only marks a request as changed; the reader builds the output when it
    gets to it, so a reader that falls behind gets several steps' tokens in one piece instead
    of a growing backlog."""

    engine: "AsyncEngine"
    handles: list[_Handle] = field(default_factory=list)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _queued: set[int] = field(default_factory=set)

    def wake(self, index: int) -> None:
        if index not in self._queued:
            self._queued.add(index)
            self._queue.put_nowait(index)

    async def _next(self) -> _Handle:
        index = await self._queue.get()
        self._queued.discard(index)
        handle = self.handles[index]
        if handle.error is not None:
            raise handle.error
        return handle

    @property
    def finished(self) -> bool:
        return all(h.state.finished for h in self.handles)

    @property
    def states(self) -> list[RequestState]:
        return [h.state for h in self.handles]

    async def changes(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, what is new)`` until every request has finished."""
        processor = self.engine.output_processor
        remaining = {h.index for h in self.handles}
        while remaining:
            handle = await self._next()
            if handle.index not in remaining:
                continue
            out = processor.make_output(handle.state, delta=True)
            if out.finished:
                remaining.discard(handle.index)
            yield handle.index, out

    async def results(self) -> list[RequestOutput]:
        """Wait for every request to finish; their complete outputs in prompt order."""
        while not self.finished:
            await self._next()
        return [self.engine.output_processor.make_output(h.state) for h in self.handles]

    async def abort(self) -> None:
        """Stop whatever has not finished (a client went away); a no-op once all finished."""
        await self.engine.abort([h.state.request_id for h in self.handles if not h.state.finished])


class AsyncEngine:
    """The engine as the API server sees it: text in, streams of ``RequestOutput``s out.

    Admission is bounded: at most ``max_num_seqs + max_queued_requests`` engine requests (one
    per prompt) are in flight; beyond that ``add_requests`` raises ``EngineOverloadedError`` and
    changes nothing. That bound also bounds every queue behind it (the ZMQ sockets, the engine's
    waiting queue), so a burst is answered with 429s instead of growing memory."""

    def __init__(self, args: EngineArgs, log_level: str = "info", max_queued_requests: int | None = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.config = EngineConfig.from_args(args)
        # The engine process must load exactly what we resolved (e.g. the demo model's path).
        self.args = args.replace(model=self.config.model.path)
        self.stall_timeout = stall_timeout
        self.max_in_flight = (None if max_queued_requests is None
                              else self.config.scheduler.max_num_seqs + max_queued_requests)
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        # Big texts are tokenized in a worker thread. Tokenizer objects are not safe to share
        # between threads (a Rust tokenizer raises "Already borrowed" when two threads use it),
        # so the worker has its own copy and each copy is only ever used by one thread.
        self._worker_input_processor = InputProcessor(self.config, load_tokenizer(self.config.model.tokenizer))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = EngineCoreClient(self.args, log_level)
        self.listeners: list[StatsListener] = []
        self.last_stats: SchedulerStats | None = None
        self.dead_reason: str | None = None
        self._on_dead: list[Callable[[str], None]] = []
        self._handles: dict[str, _Handle] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        # One thread: tokenizers are shared objects, and big inputs are rare enough to queue.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize")

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def engine_pid(self) -> int | None:
        return self.client.pid

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine core is gone or wedged (its loop has not
        turned for ``stall_timeout`` seconds). A long step is not a failure: this answers at
        once, without waiting for the engine."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if not self.client.is_alive():
            raise EngineDeadError("the engine core process is not running")
        idle = self.client.seconds_since_progress()
        if idle > self.stall_timeout:
            raise EngineDeadError(f"the engine core has made no progress for {idle:.0f} s "
                                  f"(limit {self.stall_timeout:g} s)")

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once if the engine core dies."""
        self._on_dead.append(callback)

    async def start(self) -> ReadyMsg:
        ready = await self.client.start()
        self._tasks = [asyncio.create_task(self._output_loop(), name="pagoda-engine-outputs"),
                       asyncio.create_task(self._watchdog(), name="pagoda-engine-watchdog")]
        return ready

    # ---- text ------------------------------------------------------------------------------
    async def _offload(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(input_processor, *args)``: inline with the event loop's tokenizer for small
        inputs, in the worker thread with the worker's own tokenizer for big ones."""
        if size <= LARGE_TEXT_CHARS:
            return fn(self.input_processor, *args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn,
                                                                self._worker_input_processor, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._offload(len(text), _encode, text, add_special_tokens)

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        size = sum(len(str(m.get("content") or "")) for m in messages)
        return await self._offload(size, InputProcessor.apply_chat_template, messages, add_generation_prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt: PromptInput) -> None:
        """Raise ``ValueError`` (a 400 for the client) if the prompt cannot run as asked."""
        self.input_processor.validate(prompt.token_ids, prompt.params)
        n, max_tokens, limit = len(prompt.token_ids), prompt.params.max_tokens, self.max_model_len
        if max_tokens is not None and n + max_tokens > limit:
            raise ValueError(f"max_tokens ({max_tokens}) plus the prompt's {n} tokens exceed max_model_len "
                             f"{limit}; lower max_tokens to at most {limit - n}")

    async def add_requests(self, request_id: str, prompts: list[PromptInput]) -> RequestGroup:
        """Validate every prompt, then send them all; request ``i`` is ``{request_id}-{i}``.
        Raises ``ValueError`` (invalid), ``EngineOverloadedError`` (queue full) or
        ``EngineDeadError``; all or none of the prompts are sent."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        for prompt in prompts:
            self.validate(prompt)
        if self.max_in_flight is not None and len(self._handles) + len(prompts) > self.max_in_flight:
            raise EngineOverloadedError(f"the server is at capacity ({len(self._handles)} requests in flight, "
                                        f"at most {self.max_in_flight}); retry later")
        group = RequestGroup(self)
        now = time.time()
        # Every handle is registered before the first await, so concurrent calls see an exact count.
        for i, prompt in enumerate(prompts):
            rid = f"{request_id}-{i}"
            state = self.output_processor.add_request(rid, prompt.text, prompt.token_ids, prompt.params, now)
            group.handles.append(_Handle(i, state, group))
            self._handles[rid] = group.handles[-1]
        for handle, prompt in zip(group.handles, prompts):
            request = EngineCoreRequest(handle.state.request_id, prompt.token_ids, prompt.params, now)
            await self.client.send(AddRequestMsg(request))
        return group

    async def abort(self, request_ids: list[str]) -> None:
        aborts = []
        for rid in request_ids:
            self.output_processor.requests.pop(rid, None)
            if self._handles.pop(rid, None) is not None:
                aborts.append(AbortRequest(rid))
        if aborts and not self.is_dead:
            for listener in self.listeners:
                listener.on_request_aborted(len(aborts))
            await self.client.send(AbortMsg(aborts))

    async def call_utility(self, method: str, timeout: float = 10.0) -> Any:
        """Run a utility method in the engine core between steps (``ping``, ``stats``,
        ``reset_prefix_cache``). Raises ``EngineDeadError`` or ``TimeoutError``."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self.client.send(UtilityMsg(call_id, method))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    # ---- the output handler ----------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.client.recv()
                if isinstance(msg, OutputsMsg):
                    await self._on_outputs(msg.outputs)
                elif isinstance(msg, UtilityResultMsg):
                    self._on_utility_result(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here would hang every request: treat it as a dead engine
            logger.exception("the engine output handler failed")
            self._mark_dead(f"the engine output handler failed: {type(exc).__name__}: {exc}")

    async def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        iteration = IterationStats(outs.timestamp)
        states, aborts = self.output_processor.process(outs.outputs, iteration)
        if aborts:  # stop strings found here: the engine must stop those samples
            await self.client.send(AbortMsg(aborts))
        for state in states:
            handle = self._handles.get(state.request_id)
            if handle is None:
                continue
            if state.finished:
                del self._handles[state.request_id]
                for listener in self.listeners:
                    listener.on_request_finished(state)
            handle.wake()
        for error in outs.errors:
            self.output_processor.requests.pop(error.request_id, None)
            handle = self._handles.pop(error.request_id, None)
            if handle is None:
                continue
            if error.status < 500:
                handle.fail(ValueError(error.message))
            else:
                logger.error("request %s failed in the engine: %s", error.request_id, error.message)
                handle.fail(RequestFailedError(error.message))
        for listener in self.listeners:
            listener.on_iteration(iteration)
        if outs.stats is not None:
            self.last_stats = outs.stats
            for listener in self.listeners:
                listener.on_engine_stats(outs.stats)

    def _on_utility_result(self, msg: UtilityResultMsg) -> None:
        future = self._calls.get(msg.call_id)
        if future is None or future.done():
            return
        if msg.error is not None:
            future.set_exception(RuntimeError(msg.error))
        else:
            future.set_result(msg.result)

    # ---- faults and shutdown ---------------------------------------------------------------
    async def _watchdog(self) -> None:
        while self.client.is_alive():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        code = self.client.process.exitcode if self.client.process else None
        reason = f"the engine core process exited unexpectedly (exit code {code})"
        if self.client.error:
            reason += f": {self.client.error}"
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        """Fail everything in flight at once, so no client waits on an engine that is gone."""
        if self.is_dead:
            return
        logger.error("%s", reason)
        self.dead_reason = reason
        error = EngineDeadError(reason)
        for handle in list(self._handles.values()):
            handle.fail(error)
        self._handles.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        for callback in self._on_dead:
            callback(reason)

    async def shutdown(self) -> None:
        """Abort what is left, stop the background tasks and the engine-core process."""
        if not self.is_dead and self._handles:
            await self.abort(list(self._handles))
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)
        self.dead_reason = self.dead_reason or "the server is shutting down"
        await self.client.shutdown()
        self._tokenize_pool.shutdown(wait=False)
