"""The engine core's side of structured output: compile grammars off the step loop, cache them,
give each constrained sequence its matcher, and fill each step's token bitmask.

A constrained request is queued at once but the scheduler does not admit it until its grammar
is compiled (``GrammarHandle.ready``); compiles run on a small thread pool, so a schema that
takes seconds delays only its own request while every other request keeps stepping. Compiled
grammars are cached by the constraint's key (``StructuredOutputsParams.key``): a repeated schema
costs nothing, and concurrent requests with the same new schema share one compile.

Per step (``fill``), every scheduled sequence that samples and is constrained gets a matcher
(made from the compiled grammar on first use; forked for the samples of ``n > 1``), and one
bitmask row per scored position (1, or ``1 + k`` with ``k`` draft tokens), attached to its
``ScheduledSeq.bitmask``; the model runner hands the rows to the sampling pipeline. Matchers
advance in ``Scheduler._append`` with the tokens a step emits; masks for draft positions are
computed by advancing through the drafts and rolling back, so rejected drafts never touch the
matcher. Preemption keeps the matcher (the sequence keeps its tokens). A constraint with
``start_after_token_id`` (a reasoning model's end of thinking) gets no matcher and no mask until
that token is in the sequence's output (``StructuredOutputsParams.grammar_start``, which also
skips occurrences after ``start_skip_after``), so the tokens up to it are free.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pagoda.structured_output.backend import GrammarBackend, GrammarLimitError, MaskJob, make_backend
from pagoda.structured_output.params import StructuredOutputsParams
from pagoda.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.request import Request, Sequence
    from pagoda.step import SchedulerOutput

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256
COMPILE_THREADS = 2
# The compile threads' stacks. The front end's sandbox probes every constraint on a stack of
# ``sandbox.DEFAULT_STACK_MIB``; compiling the same constraint here on a stack 16 times larger
# keeps a deeply nested grammar that passed there from overflowing this process's stack.
COMPILE_STACK_MIB = 64


class GrammarHandle:
    """A request's grammar: compiling, compiled or failed. The scheduler reads ``ready``."""

    __slots__ = ("future",)

    def __init__(self, future: "Future[Any]") -> None:
        self.future = future

    @property
    def ready(self) -> bool:
        return self.future.done() and self.future.exception() is None

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None


class StepBitmask:
    """One step's bitmask (int32 ``[rows, ceil(vocab / 32)]``), filled on a worker thread."""

    def __init__(self, bitmask: Any) -> None:
        self.bitmask = bitmask
        self.future: Future[None] | None = None
        self.errors: dict[int, Exception] = {}  # first row -> why its mask failed


class BitmaskRows:
    """A sequence's rows of the step's bitmask (``ScheduledSeq.bitmask``): ``rows()`` waits
    for the fill and returns ``[positions, words]``, or raises if this sequence's mask failed."""

    __slots__ = ("step", "row", "count")

    def __init__(self, step: StepBitmask, row: int, count: int) -> None:
        self.step, self.row, self.count = step, row, count

    def rows(self) -> Any:
        if self.step.future is not None:
            self.step.future.result()
        error = self.step.errors.get(self.row)
        if error is not None:
            raise error
        return self.step.bitmask[self.row:self.row + self.count]

    def attach(self, row: Any) -> None:
        """Give a sampler row (``executor.sampler.SampleRow``) this sequence's mask."""
        row.bitmask = self.rows()[0]


class DeferredMask:
    """A sequence whose mask this step is computed only if the sampler needs it.

    The sampler samples from the unmasked distribution first and asks ``allows(token)`` (one
    matcher check, no mask); only a refused token makes it call ``rows()`` (the mask, computed
    then, for all refused rows of the step at once: ``fill_many``) and sample again from the
    masked distribution with the same random draw. Why that is exact: executor.sampler.resample_refused.
    """

    __slots__ = ("manager", "matcher", "mask")

    def __init__(self, manager: "StructuredOutputManager", matcher: Any) -> None:
        self.manager, self.matcher, self.mask = manager, matcher, None

    def attach(self, row: Any) -> None:
        row.grammar = self

    def allows(self, token: int) -> bool:
        ok = self.matcher.allows(token)
        DeferPolicy.record(self.matcher, ok)
        if not ok:
            self.manager.stats["refused"] += 1
        return ok

    def rows(self) -> Any:
        if self.mask is None:
            DeferredMask.fill_many([self])
        _raise_limit(self.matcher)
        return self.mask

    @staticmethod
    def fill_many(items: list["DeferredMask"]) -> None:
        """Compute the masks of ``items`` that lack one, in one backend call."""
        import torch

        todo = [d for d in items if d.mask is None]
        if not todo:
            return
        manager = todo[0].manager
        bitmask = torch.full((len(todo), manager.backend().mask_words), -1, dtype=torch.int32)
        manager.backend().fill_bitmask(bitmask, [(d.matcher, i, []) for i, d in enumerate(todo)])
        for i, d in enumerate(todo):
            d.mask = bitmask[i:i + 1]


def _raise_limit(matcher: Any) -> None:
    """Raise ``GrammarLimitError`` if computing a mask stopped ``matcher`` at a limit."""
    error = matcher.limit_error()
    if error is not None:
        raise GrammarLimitError.of(error)


class DeferPolicy:
    """Which constrained rows defer their mask (sample first, mask only on refusal).

    Deferring pays when the model mostly samples tokens the grammar allows (a model that
    follows the schema: the mask is then never computed) and costs a little when it does not
    (a refused row computes its mask after the forward pass instead of during it and samples
    twice). So each matcher backs off: a refusal makes the sequence compute its mask ahead for
    the next 1, 2, 4, ... ``MAX_BACKOFF`` steps before it tries deferring again; an accepted
    token resets the back-off. A model that ignores the grammar thus defers about one step in
    ``MAX_BACKOFF``.

    Only rows whose distribution restricted to the grammar is the unmasked one renormalised
    defer: greedy rows, and random rows without top-k / top-p / min-p truncation (those
    truncate the masked distribution, which is not the truncated one masked) that are past
    ``min_tokens`` (whose stop-token suppression depends on the mask). Rows scoring draft
    tokens never defer. Everything else keeps the mask computed during the forward pass."""

    MAX_BACKOFF = 32
    enabled = True

    @staticmethod
    def eligible(seq: "Sequence", vocab_size: int) -> bool:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            return False
        return p.greedy or ((p.top_k <= 0 or p.top_k >= vocab_size) and p.top_p >= 1.0 and p.min_p <= 0)

    @classmethod
    def defer(cls, matcher: Any) -> bool:
        """Whether to defer this step (called once per step per eligible sequence)."""
        if matcher.defer_wait > 0:
            matcher.defer_wait -= 1
            return False
        return True

    @classmethod
    def record(cls, matcher: Any, allowed: bool) -> None:
        if allowed:
            matcher.defer_backoff = 0
        else:
            matcher.defer_backoff = min(2 * matcher.defer_backoff or 1, cls.MAX_BACKOFF)
            matcher.defer_wait = matcher.defer_backoff


class StructuredOutputManager:
    def __init__(self, config: "EngineConfig", tokenizer: Any = None) -> None:
        self.config = config
        self.backend_name = config.structured_outputs_backend
        self._tokenizer = tokenizer
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self._in_flight: Future[None] | None = None
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._pending: list[Request] = []
        self.num_compiles = 0
        # Sample first and compute a row's mask only when the sampled token is refused
        # (DeferPolicy); False computes every mask ahead (the benchmark compares both).
        self.defer_masks = DeferPolicy.enabled
        # Sequence-steps whose mask was computed ahead, deferred, and deferred but then needed.
        self.stats = {"ahead": 0, "deferred": 0, "refused": 0}

    # ---- compiling -----------------------------------------------------------------------
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (loading the tokenizer's vocabulary takes a while,
        so it happens on a compile thread, never in the step loop)."""
        with self._backend_lock:
            if self._backend is None:
                tokenizer = self._tokenizer
                if tokenizer is None:
                    tokenizer = load_tokenizer(self.config.model.tokenizer)
                model = self.config.model
                self._backend = make_backend(self.backend_name, tokenizer, model.vocab_size, model.eos_token_ids)
            return self._backend

    def add(self, request: "Request") -> None:
        """Start compiling ``request``'s grammar (or reuse a cached one)."""
        params = request.params.structured_outputs
        if params is None:
            return
        request.grammar = GrammarHandle(self._compiled(params))
        if not request.grammar.future.done():
            self._pending.append(request)
        elif request.grammar.error is not None:
            self._pending.append(request)

    def _compiled(self, params: StructuredOutputsParams) -> "Future[Any]":
        key = params.key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagoda-grammar")
        # The pool starts its threads on submit: the stack size in force then is theirs.
        threading.stack_size(COMPILE_STACK_MIB << 20)
        try:
            future = self._pool.submit(self._compile, params)
        finally:
            threading.stack_size(0)
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiled = self.backend().compile(params)
        self.num_compiles += 1
        return compiled

    def take_failed(self) -> list[tuple["Request", str]]:
        """Requests whose grammar failed to compile since the last call (to refuse with a 400);
        requests still compiling stay pending."""
        failed, pending = [], []
        for request in self._pending:
            handle = request.grammar
            if not handle.future.done():
                pending.append(request)
            elif handle.error is not None:
                failed.append((request, str(handle.error)))
        self._pending = pending
        return failed

    def wait_compiling(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a pending compile (called when nothing else can
        run, so an idle engine waiting for a grammar does not spin)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        futures = [r.grammar.future for r in self._pending if not r.grammar.future.done()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- each step -----------------------------------------------------------------------
    def fill(self, sched: "SchedulerOutput") -> list[tuple["Sequence", Exception]]:
        """Attach bitmask rows to the scheduled sequences that sample under a grammar. Returns
        the sequences whose masks could not be computed (their requests must end)."""
        jobs: list[tuple[Any, MaskJob]] = []
        failed: list[tuple[Sequence, Exception]] = []
        rows = 0
        vocab = self.config.model.vocab_size
        for item in sched.scheduled:
            seq = item.seq
            if seq.request.grammar is None or not item.samples:
                continue
            try:
                if seq.grammar is None:
                    seq.grammar = self._start_matcher(seq)
            except Exception as exc:
                failed.append((seq, exc))
                continue
            if seq.grammar is None:
                continue  # its constraint has not started: this token is free
            drafts = item.draft.token_ids if item.draft is not None else []
            if (self.defer_masks and not drafts and DeferPolicy.eligible(seq, vocab)
                    and DeferPolicy.defer(seq.grammar)):
                item.bitmask = DeferredMask(self, seq.grammar)
                self.stats["deferred"] += 1
                continue
            self.stats["ahead"] += 1
            jobs.append((item, (seq.grammar, rows, drafts)))
            rows += 1 + len(drafts)
        if not jobs:
            return failed
        import torch

        step = StepBitmask(torch.full((rows, self.backend().mask_words), -1, dtype=torch.int32))
        # Computed while the forward pass runs; the sampler waits for it (BitmaskRows.rows).
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-mask")
        step.future = self._mask_pool.submit(self._fill, step, [job for _, job in jobs])
        self._in_flight = step.future
        for item, (_, row, drafts) in jobs:
            item.bitmask = BitmaskRows(step, row, 1 + len(drafts))
        return failed

    def _start_matcher(self, seq: "Sequence") -> Any:
        """``seq``'s matcher, made when it first samples under its constraint; None while the
        constraint waits for its ``start_after_token_id``. Tokens that came after that token in
        the step that generated it (accepted drafts) were not masked: the new matcher takes them,
        and refuses the sequence (it ends alone) if the grammar does not allow them."""
        after: list[int] = []
        if seq.params.structured_outputs.start_after_token_id is not None:
            output = seq.output_token_ids
            start = seq.params.structured_outputs.grammar_start(output)
            if start is None:
                return None
            after = output[start:]
        matcher = self.backend().matcher(seq.request.grammar.future.result(timeout=0))
        for token in after:
            if not matcher.accept(token):
                raise ValueError(f"token {token}, generated unconstrained in the step that started the "
                                 "constraint, is not allowed by the grammar")
        return matcher

    def finish_step(self) -> None:
        """Wait for the step's mask computation (the matchers are read there and advanced by
        the scheduler's update right after), whether or not the sampler used all of it."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.exception()  # its errors are per row, reported through BitmaskRows

    def _fill(self, step: "StepBitmask", jobs: list[MaskJob]) -> None:
        """All the step's masks in one call; if that fails, job by job, so that only the rows
        whose own mask fails are lost (their requests end in the sampler)."""
        backend = self.backend()
        try:
            backend.fill_bitmask(step.bitmask, jobs)
        except Exception:
            logger.warning("batched grammar mask failed; computing row by row", exc_info=True)
            for job in jobs:
                try:
                    backend.fill_bitmask(step.bitmask, [job])
                except Exception as exc:
                    step.errors[job[1]] = exc
        for matcher, row, _ in jobs:  # a matcher a limit stopped ends its request alone
            try:
                _raise_limit(matcher)
            except GrammarLimitError as exc:
                step.errors.setdefault(row, exc)

    def shutdown(self) -> None:
        for pool in (self._pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
