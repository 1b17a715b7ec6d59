"""The engine as the API server's HTTP handlers see it: text in, streams of
``RequestOutput``s out.

``AsyncEngine`` tokenizes (large texts in a worker thread with its own tokenizer), bounds
admission, sends ``EngineCoreRequest``s through the ``EngineCoreClient`` (``core_client.py``)
and runs the one output-handler task that folds engine outputs into request states (incremental
detokenization, stop strings) and wakes the handler waiting on each request (``RequestGroup``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from pagoda.config import EngineArgs, EngineConfig, resolve_model_args
from pagoda.engine.core_client import (EngineCoreClient, EngineDeadError, EngineOverloadedError, EngineStartupError,
                                       RequestFailedError, RequestTimeoutError)
from pagoda.engine.input_processor import InputProcessor, PromptType
from pagoda.engine.messages import (AbortMsg, AbortRequest, AddRequestMsg, EngineCoreOutputs, EngineCoreRequest,
                                    OutputsMsg, ReadyMsg, SchedulerStats, UtilityMsg, UtilityResultMsg)
from pagoda.engine.output_processor import IterationStats, OutputProcessor, RequestState
from pagoda.generation_config import log_generation_defaults
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.omp import configure_openmp
from pagoda.outputs import RequestOutput
from pagoda.request import DEFAULT_TENANT
from pagoda.sampling_params import SamplingParams
from pagoda.sandbox import SandboxBusy
from pagoda.structured_output.validate import CHECK_WORKERS, StructuredValidator
from pagoda.tokenizer import load_tokenizer

__all__ = ["AsyncEngine", "RequestGroup", "PromptInput", "StatsListener", "DEFAULT_STALL_TIMEOUT_S",
           "EngineDeadError", "EngineOverloadedError", "EngineStartupError", "RequestFailedError",
           "RequestTimeoutError"]

logger = logging.getLogger(__name__)

# How often the watchdog checks that the engine-core process is alive.
WATCHDOG_INTERVAL_S = 0.2
# Texts longer than this are tokenized in a worker thread so the event loop keeps serving
# streams meanwhile; short ones are cheaper to do inline than to hand off.
LARGE_TEXT_CHARS = 4096
# /health reports the engine as wedged when its loop has not turned for this long. A step on a
# long prompt or a first-time kernel compile can take many seconds; only a stuck loop takes this.
DEFAULT_STALL_TIMEOUT_S = 300.0


def _template_with(processor: InputProcessor, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   kwargs: dict[str, Any]) -> str:
    return processor.apply_chat_template(messages, add_generation_prompt, **kwargs)


def _encode(processor: InputProcessor, text: str, add_special_tokens: bool) -> list[int]:
    return processor.encode(text, add_special_tokens)


class StatsListener(Protocol):
    """Receives what metrics are made of (the server's Prometheus metrics, its log line)."""

    def on_engine_stats(self, stats: SchedulerStats) -> None: ...

    def on_iteration(self, iteration: IterationStats) -> None: ...

    def on_request_finished(self, state: RequestState) -> None: ...

    def on_request_aborted(self, num_requests: int) -> None: ...

    def on_request_failed(self, state: RequestState, reason: str) -> None:
        """``state`` ended without finishing: "abort" (its client went away), "error" (the
        engine failed it) or "timeout" (its deadline passed while it waited: a 503)."""


@dataclass
class PromptInput:
    """One prompt of an API call, tokenized, with the sampling parameters it runs with."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None
    tenant: str = DEFAULT_TENANT  # who sent it (the scheduler's fair shares)
    cache_salt: str | None = None  # prefix-cache salt (the request's, or the tenant's under isolation)
    priority: int = 0  # the priority policy's order: lower first
    timeout: float | None = None  # seconds from arrival by which it must end (None: no deadline)
    background: bool = False  # the background (batch) class: runs only on capacity interactive work leaves idle
    trace_headers: dict[str, str] | None = None  # the client's traceparent / tracestate (tracing on)
    # Images, in vLLM's form (``{"image": PIL image or list}``); ``token_ids`` then hold one
    # placeholder per image. ``add_requests`` preprocesses them into ``images`` (ids expanded).
    multi_modal_data: dict | None = None
    images: list[ImageInput] = field(default_factory=list)


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
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S, name: str | None = None) -> None:
        configure_openmp()
        # The served model's name when a server holds several: a death's reason names it, so the
        # requests it fails say which model went away.
        self.name = name
        # The engine core is spawned first, from the args with hub names and the built-in model
        # resolved to local files (what it must load; no torch needed): it imports torch and
        # loads the model while this process resolves the config (importing torch too) and loads
        # its tokenizers, seconds each. It resolves the same args itself, so it refuses whatever
        # this process's config refuses; ``start`` waits for it.
        self.args = resolve_model_args(args)
        self.client = EngineCoreClient(self.args, log_level)
        self.client.launch()
        try:
            self.config = EngineConfig.from_args(self.args)
            log_generation_defaults(self.config.model.generation_defaults)
            self.stall_timeout = stall_timeout
            self.max_in_flight = (None if max_queued_requests is None
                                  else self.config.scheduler.max_num_seqs + max_queued_requests)
            self.tokenizer = load_tokenizer(self.config.model.tokenizer)
            self.input_processor = InputProcessor(self.config, self.tokenizer)
            # Constraints are checked in sandbox processes (structured_output.validate), waited
            # for on worker threads, one per sandbox worker.
            self.input_processor.structured = StructuredValidator(self.config)
            # Big texts are tokenized in a worker thread. Tokenizer objects are not safe to share
            # between threads (a Rust tokenizer raises "Already borrowed" when two threads use
            # it), so the worker has its own copy and each copy is only ever used by one thread.
            self._worker_input_processor = InputProcessor(self.config, load_tokenizer(self.config.model.tokenizer))
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            self.client.abandon()
            raise
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
        self._grammar_pool = ThreadPoolExecutor(CHECK_WORKERS, thread_name_prefix="pagoda-grammar-check")
        # OpenTelemetry spans (``tracing.RequestTracer``), set by the server with --otlp-traces-endpoint.
        self.tracer: Any = None

    def enable_tracing(self, tracer: Any) -> None:
        """Trace every request from now on with ``tracer`` (a ``RequestTracer``)."""
        self.tracer = tracer
        self.listeners.append(tracer)

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
        self.input_processor.structured.sandbox().start()  # its workers load while the engine does
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

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text of ``messages``; ``template_kwargs`` (``documents``,
        ``continue_final_message``, the template's own variables) go to the chat template."""
        size = sum(len(str(m.get("content") or "")) for m in messages)
        kwargs = {**template_kwargs, "tools": tools} if tools else template_kwargs
        if kwargs:  # the template renders them too (tools, documents, ...)
            return await self._offload(size + len(str(kwargs)), _template_with, messages, add_generation_prompt,
                                       kwargs)
        return await self._offload(size, InputProcessor.apply_chat_template, messages, add_generation_prompt)

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` for every chat prompt (``--chat-template``): set on this process's
        tokenizers (the event loop's and the tokenizer thread's). Before any request."""
        for tokenizer in {id(t): t for t in (self.tokenizer, self._worker_input_processor.tokenizer,
                                              self.input_processor.tokenizer)}.values():
            tokenizer.chat_template = template

    async def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt in any form ``LLM.generate`` takes
        (``InputProcessor.tokenize``), on the tokenizer thread: a prompt with images, in vLLM's
        form ``{"prompt": text, "multi_modal_data": {"image": [...]}}``, is processed there."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, InputProcessor.tokenize,
                                                                self._worker_input_processor, prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt: PromptInput) -> None:
        """Raise ``ValueError`` (a 400 for the client) if the prompt cannot run as asked: the
        same rules as offline ``LLM.generate`` (``InputProcessor.validate``)."""
        self.input_processor.validate(prompt.token_ids, prompt.params)

    async def process_images(self, multi_modal_data: dict, token_ids: list[int]) -> tuple[list[int], list[ImageInput]]:
        """``InputProcessor.process_images`` on the worker thread (off the event loop): the
        images preprocessed and ``token_ids`` with their placeholders expanded; ``ParamError``
        (400) for bad images."""
        return await self._offload(LARGE_TEXT_CHARS + 1, InputProcessor.process_images, multi_modal_data, token_ids)

    async def _preprocess_images(self, prompt: PromptInput) -> None:
        """Preprocess ``prompt.multi_modal_data`` unless the caller did (``prompt.images``)."""
        if prompt.multi_modal_data is None or prompt.images:
            return
        prompt.token_ids, prompt.images = await self.process_images(prompt.multi_modal_data, prompt.token_ids)

    async def _check_grammars(self, prompts: list[PromptInput]) -> None:
        """Structured-output constraints not seen before are checked in the validator's sandbox
        (waited for on a worker thread), so ``validate`` then finds them known; every sandbox
        worker busy for the whole check timeout is an overload (429)."""
        validator = self.input_processor.structured
        for prompt in prompts:
            params = prompt.params.structured_outputs if isinstance(prompt.params, SamplingParams) else None
            if params is not None and not validator.is_known(params):
                try:
                    await asyncio.get_running_loop().run_in_executor(self._grammar_pool, validator.validate, params)
                except SandboxBusy as exc:
                    raise EngineOverloadedError("every constraint checker is busy; retry later") from exc

    async def add_requests(self, request_id: str, prompts: list[PromptInput]) -> RequestGroup:
        """Validate every prompt, then send them all; request ``i`` is ``{request_id}-{i}``.
        Raises ``ValueError`` (invalid), ``EngineOverloadedError`` (queue full) or
        ``EngineDeadError``; all or none of the prompts are sent."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        await self._check_grammars(prompts)
        for prompt in prompts:
            prompt.token_ids = self.input_processor.truncate(prompt.token_ids, prompt.params,
                                                             prompt.multi_modal_data is not None or bool(prompt.images))
            await self._preprocess_images(prompt)
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
            state.priority = prompt.priority
            lora = prompt.lora_request.lora_name if prompt.lora_request is not None else None
            state.lora_name = lora
            if self.tracer is not None:
                state.trace = self.tracer.start(rid, prompt.trace_headers, now, prompt.params, lora, prompt.priority)
            group.handles.append(_Handle(i, state, group))
            self._handles[rid] = group.handles[-1]
        for handle, prompt in zip(group.handles, prompts):
            deadline = now + prompt.timeout if prompt.timeout is not None else None
            request = EngineCoreRequest(handle.state.request_id, prompt.token_ids, prompt.params, now,
                                        prompt.lora_request, prompt.tenant, prompt.cache_salt, prompt.priority,
                                        deadline, handle.state.trace is not None, prompt.images,
                                        prompt.background)
            await self.client.send(AddRequestMsg(request))
        return group

    async def abort(self, request_ids: list[str]) -> None:
        aborts = []
        for rid in request_ids:
            self.output_processor.requests.pop(rid, None)
            handle = self._handles.pop(rid, None)
            if handle is not None:
                aborts.append(AbortRequest(rid))
                self._ended(handle.state, "abort")
        if aborts and not self.is_dead:
            for listener in self.listeners:
                listener.on_request_aborted(len(aborts))
            await self.client.send(AbortMsg(aborts))

    async def call_utility(self, method: str, timeout: float = 10.0, args: list | None = None) -> Any:
        """Run a utility method in the engine core between steps (``ping``, ``stats``,
        ``reset_prefix_cache``, ``add_lora``, ``remove_lora``). Raises ``EngineDeadError``,
        ``TimeoutError`` or ``RuntimeError`` (the method failed; its message)."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self.client.send(UtilityMsg(call_id, method, list(args or [])))
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
            self._ended(handle.state, "timeout" if error.status == 503 else "error")
            if error.status == 503:  # its deadline passed while it waited
                handle.fail(RequestTimeoutError(error.message))
            elif error.status < 500:
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

    def _ended(self, state: RequestState, reason: str) -> None:
        for listener in self.listeners:
            listener.on_request_failed(state, reason)

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
        if self.name is not None:
            reason = f"model {self.name!r}: {reason}"
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
        if self.tracer is not None:  # export the spans still buffered (a background flush, bounded by the SDK)
            await asyncio.to_thread(self.tracer.shutdown)
        self._tokenize_pool.shutdown(wait=False)
        self._grammar_pool.shutdown(wait=False)
        self.input_processor.structured.shutdown()
