"""The engine core: scheduler + KV-cache manager + model executor, one ``step()`` at a time.

``step`` is schedule -> execute -> update. It knows nothing of text or HTTP: requests arrive
as token ids and results leave as token ids.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import msgspec
from typing import TYPE_CHECKING, Callable

from pagoda.config import AUTO_MAX_STEPS, AUTO_STEPS_BURST_S, EngineConfig, ModelConfig
from pagoda.engine import async_scheduling
from pagoda.engine.async_scheduling import InFlight, StepPipeline
from pagoda.engine.messages import (AbortRequest, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, RequestError,
                                    SchedulerStats)
from pagoda.executor.interface import Executor
from pagoda.kvcache.manager import KVCacheManager
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import check_images
from pagoda.request import Request, SeqStatus, Sequence
from pagoda.scheduler.priority import QUEUE_TIMEOUT_PREFIX
from pagoda.scheduler.scheduler import Scheduler, SeqUpdate
from pagoda.step import Draft, ModelOutput, SchedulerOutput
from pagoda.structured_output.backend import GrammarLimitError
from pagoda.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pagoda.kvcache.tiers.store import TieredStore
    from pagoda.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)

# With nothing runnable but a grammar compiling, a step waits this long for it instead of spinning.
GRAMMAR_WAIT_S = 0.005
# Tenants named in the stats (the busiest); the rest are summed under "other", so per-tenant
# metrics have a bounded number of label values however many tenants send requests.
TENANT_STATS_LIMIT = 8


def build_executor(config: EngineConfig) -> Executor:
    if config.parallel.tensor_parallel_size > 1 or config.parallel.pipeline_parallel_size > 1:
        from pagoda.executor.tp_executor import TPExecutor

        return TPExecutor(config)
    from pagoda.executor.model_runner import ModelRunner

    return ModelRunner(config)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor: Executor = build_executor(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self._check_capacity(num_blocks)
            self.executor.allocate_kv_cache(num_blocks)
            self.executor.capture_cuda_graphs()
            windows = config.model.sliding_windows  # released blocks only if every layer has a window
            self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                     config.cache.eviction_policy,
                                     max(windows) if windows and None not in windows else None,
                                     getattr(self.executor, "num_state_slots", 0))
            self.kv_store = self._attach_kv_tiers()
            self.scheduler = Scheduler(config.scheduler, self.kv, self._encoder_cached)
            self.proposer = self._make_proposer()
            self.structured = StructuredOutputManager(config)
            self._refused: list[RequestError] = []
            self.loras: dict[int, LoRARequest] = {}  # adapters added, by id
            self._loras_to_remove: set[int] = set()  # unloaded while requests still use them
            # Multi-step decoding: off where the executor cannot run lookahead steps (tensor /
            # pipeline ranks) or drafts are proposed; else fixed, or chosen from the time of a
            # decode step (``decode_step_s``, a running average over decode-only rounds).
            fixed = config.scheduler.num_scheduler_steps
            self._steps_fixed = 1 if not getattr(self.executor, "runs_lookahead", False) or self.proposer else fixed
            self.decode_step_s: float | None = None
            self.sleeping = 0  # sleep mode: 0 awake, else the level slept at
            # Async scheduling: the step in flight, and outputs of steps finished outside ``step``.
            self._pipeline = self._make_pipeline()
            self._flight: InFlight | None = None
            self._stash: list[EngineCoreOutputs] = []
            # Background-only steps given up for interactive work (``abandon_background_when``).
            self.num_abandoned_steps = 0
        except BaseException:
            self.shutdown()  # a tensor-parallel executor has worker processes to stop
            raise
        self._log_capacity(num_blocks)

    def _make_pipeline(self) -> StepPipeline | None:
        """The worker that runs steps while the next one is scheduled (``--async-scheduling``);
        None when it is off or this engine cannot use it (logged)."""
        if not self.config.scheduler.async_scheduling:
            return None
        why = async_scheduling.unsupported(self.config, self.executor, self.proposer is not None,
                                           self.kv_store is not None)
        if why is not None:
            logger.warning("async scheduling is off for this engine: %s runs synchronously", why)
            return None
        return StepPipeline(self.executor)  # type: ignore[arg-type]

    def _encoder_cached(self, image_hash: str) -> bool:
        """Whether the runner's encoder cache holds this image's features (the scheduler's
        encoder budget counts them free). A vision-language model runs in this process's
        ``ModelRunner`` (tensor and pipeline size 1), whose ``mm`` holds the cache."""
        mm = getattr(self.executor, "mm", None)
        return mm is not None and image_hash in mm.cache

    def _attach_kv_tiers(self) -> TieredStore | None:
        """The KV tiers (``--kv-offload-*``), shared by the KV-cache manager (which blocks move)
        and the executor (the copies); None without them."""
        from pagoda.kvcache.tiers import make_tiered_store

        store = make_tiered_store(self.config)
        if store is not None:
            from pagoda.kvcache.tiers.keys import model_identity

            self.executor.attach_kv_store(store)  # type: ignore[attr-defined]
            self.kv.attach_tiers(store, model_identity(self.config))
        return store

    def _flush_kv_saves(self) -> None:
        """Snapshot the blocks the tiers are owed now, so that they reach disk / Redis while the
        engine idles (and before it stops), not at its next step."""
        transfers = self.kv.take_transfers() if self.kv_store is not None else None
        if transfers:
            self.executor.transfer_kv(transfers)  # type: ignore[attr-defined]

    def _make_proposer(self) -> Proposer | None:
        if self.config.speculative is None:
            return None
        from pagoda.spec_decode import make_proposer

        return make_proposer(self.config, self.executor)

    def _check_capacity(self, num_blocks: int) -> None:
        tokens = num_blocks * self.config.cache.block_size
        if tokens < self.config.model.max_model_len:
            raise ValueError(
                f"the KV cache holds {tokens} tokens ({num_blocks} blocks), fewer than max_model_len "
                f"{self.config.model.max_model_len}: give it more memory (kv_cache_memory / "
                f"gpu_memory_utilization) or lower max_model_len")

    def _log_capacity(self, num_blocks: int) -> None:
        cfg = self.config
        tokens = num_blocks * cfg.cache.block_size
        per_rank = " per rank" if cfg.parallel.tensor_parallel_size * cfg.parallel.pipeline_parallel_size > 1 else ""
        logger.info("KV cache%s (%s): %d blocks of %d tokens = %d tokens (%.2f GiB%s); fits %.1f requests of "
                    "max_model_len %d", per_rank, str(cfg.cache.kv_cache_dtype).removeprefix("torch."), num_blocks,
                    cfg.cache.block_size, tokens,
                    num_blocks * self.executor.kv_bytes_per_block() / 2**30, per_rank,
                    tokens / cfg.model.max_model_len, cfg.model.max_model_len)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Raises ``ValueError`` (the request's fault) or anything else building
        its state raises; either way nothing of it is left in the engine."""
        self._check_request(req)
        if req.params.seed is not None:
            int(req.params.seed)  # the executor seeds the request's generators from it
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        request = Request(req.request_id, req.prompt_token_ids, req.params, self.config.model.eos_token_ids,
                          arrival_time=req.arrival_time, lora_request=req.lora_request, tenant=req.tenant,
                          cache_salt=req.cache_salt, priority=req.priority, deadline=req.deadline,
                          trace_events=[] if req.trace else None, images=list(req.images),
                          background=req.background)
        self.scheduler.add_request(request)
        self.structured.add(request)  # compiles off the step loop; admitted once compiled

    def _check_request(self, req: EngineCoreRequest) -> None:
        """What the front end validates, checked again where a slip would stop the engine: a
        token id outside the vocabulary fails the forward pass of the whole batch."""
        ids, model = req.prompt_token_ids, self.config.model
        if not ids:
            raise ValueError("the prompt is empty")
        pooled = req.params.pooling is not None  # an embedding's prompt may fill the context
        if len(ids) > model.max_model_len or (len(ids) == model.max_model_len and not pooled):
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {model.max_model_len}")
        if not all(type(t) is int and 0 <= t < model.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        if req.images:
            check_images(ids, req.images, model.hf_config if model.is_multimodal else None)
        n = req.params.n
        if type(n) is not int or not 1 <= n <= self.config.scheduler.max_num_seqs:
            raise ValueError(f"n must be an integer in [1, max_num_seqs={self.config.scheduler.max_num_seqs}], "
                             f"got {n!r}")

    # ---- LoRA adapters -------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> None:
        """Load and check an adapter (``ValueError`` if it cannot be served, or if its id is
        already another adapter's). Requests name it by its ``LoRARequest``."""
        self._drain()
        if self.config.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        known = self.loras.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {known.lora_name!r} "
                             f"({known.lora_path}); give each adapter its own id")
        if known is None:
            self.executor.add_lora(lora)
            self.loras[lora.lora_int_id] = lora
        self._loras_to_remove.discard(lora.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter. Requests already using it finish with it first (it goes when the
        last of them leaves); returns False for an unknown id."""
        self._drain()
        if lora_int_id not in self.loras:
            return False
        self._loras_to_remove.add(lora_int_id)
        self._remove_unused_loras()
        return True

    def _remove_unused_loras(self) -> None:
        in_use = {seqs[0].request.lora_request.lora_int_id for seqs in self.scheduler.requests.values()
                  if seqs and seqs[0].request.lora_request is not None}
        for lora_id in list(self._loras_to_remove - in_use):
            self.executor.remove_lora(lora_id)
            del self.loras[lora_id]
            self._loras_to_remove.discard(lora_id)

    def abort(self, abort: AbortRequest) -> list[EngineCoreOutput]:
        """Stop a request or one sample. Returns final outputs for what was still running."""
        seqs = self.scheduler.requests.get(abort.request_id, [])
        if abort.index is None:
            ended = [s for s in self.scheduler.abort_request(abort.request_id) if s.finish_reason == "abort"]
            return [self._output(SeqUpdate(s, [])) for s in ended]
        for seq in seqs:
            if seq.sample_index == abort.index and not seq.finished:
                # Also when it is waiting (preempted): a stop string ends it all the same.
                self.scheduler.finish_sequence(seq, abort.reason, abort.stop_reason)
        return []

    def take_errors(self) -> list[RequestError]:
        """Requests that failed inside the engine since the last call, each to report once.
        A constraint stopped by the grammar limits is the client's fault (400, its message for
        the client); every other failure is the engine's (500)."""
        refused, self._refused = self._refused, []
        ids = {e.request_id for e in refused}
        return refused + [_failure(rid, reason) for rid, reason in self.scheduler.take_failed().items()
                          if rid not in ids]

    def check_health(self) -> None:
        """Raise if the executor has lost part of itself (a worker, another node), so that an
        idle engine fails too instead of waiting for a request to find out."""
        check = getattr(self.executor, "check_health", None)  # executors with workers have one
        if check is not None:
            check()

    def has_unfinished(self) -> bool:
        """Work to step on: unfinished requests, and the engine awake (asleep, they wait)."""
        return bool(self._stash) or (not self.sleeping and self.scheduler.has_unfinished())

    # ---- sleep mode ----------------------------------------------------------------------
    def sleep(self, level: int) -> int:
        """Release the KV cache (level 1) and the weights (level 2); returns the bytes released.
        Running requests are preempted and, like requests that arrive meanwhile, wait for
        ``wake_up`` (their deadlines then apply as usual). A deeper level while asleep goes deeper."""
        self._drain()
        self._check_sleep_mode()
        if level not in (1, 2):
            raise ValueError(f"level must be 1 (release the KV cache) or 2 (the weights too), got {level!r}")
        if level <= self.sleeping:
            return 0
        self.scheduler.preempt_all()
        self.kv.reset_prefix_cache()  # the cached blocks' contents go with the cache
        freed = self.executor.sleep(level)  # type: ignore[attr-defined]
        self.sleeping = level
        logger.info("asleep (level %d): %.1f MiB released", level, freed / 2**20)
        return freed

    def wake_up(self) -> None:
        """Reload what ``sleep`` released; waiting requests run again."""
        self._check_sleep_mode()
        if self.sleeping:
            self.executor.wake_up()  # type: ignore[attr-defined]
            self.sleeping = 0
            logger.info("awake")

    def update_weights(self, path: str) -> None:
        """Serve the checkpoint in directory ``path`` from now on: same architecture and shapes
        (``ValueError`` otherwise, the old weights kept). Running requests are recomputed with
        the new weights and the prefix cache is emptied (its KV came from the old ones)."""
        self._drain()
        self._check_sleep_mode()
        if self.sleeping:
            raise ValueError("the engine is asleep: wake it up before updating its weights")
        model = same_shaped_checkpoint(self.config.model, path)
        self.scheduler.preempt_all()
        self.kv.reset_prefix_cache()
        self.config = dataclasses.replace(self.config, model=model)
        self.executor.reload_weights(self.config)  # type: ignore[attr-defined]
        logger.info("now serving the weights of %s", path)

    def _check_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep, wake-up and weight updates need the engine started with enable_sleep_mode "
                             "(--enable-sleep-mode)")

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One schedule -> execute -> update round.

        Per-request fault isolation: a failure in one request's own work (sampling, draft
        verification, its update and stop checks) ends that request alone, reported in
        ``errors`` (status 500) with its blocks freed, and the rest of the batch gets its
        tokens in this same step. A failed draft proposal only means no drafts this step.
        Failures that leave shared state unknown (the forward pass, block copies) still raise."""
        if self._pipeline is not None:
            return self._step_async()
        self._refuse_bad_grammars()
        sched = self._schedule(self._propose(), self.num_steps())
        start = time.perf_counter()
        try:
            result = self.executor.execute(sched)
        finally:
            self.structured.finish_step()
        self._time_decode(sched, result, time.perf_counter() - start)
        return self._apply(sched, result)

    def _schedule(self, drafts: dict[str, Draft], num_steps: int, wait: bool = True) -> SchedulerOutput:
        """The next step's batch with its grammar masks; ``wait``: with nothing runnable, wait a
        moment for a grammar or a KV-tier load rather than spin."""
        sched = self.scheduler.schedule(drafts, num_steps)
        self._fill_grammar_masks(sched)
        if sched.is_empty and wait:
            self.structured.wait_compiling(GRAMMAR_WAIT_S)
            if self.kv_store is not None:
                self.kv_store.wait_for_loads(GRAMMAR_WAIT_S)
        return sched

    def _step_async(self) -> EngineCoreOutputs:
        """``step`` with async scheduling: submit this step if none is in flight; schedule and
        submit the next one while it runs, when it may run ahead (``async_scheduling``); then
        wait for this one and apply its results. Outputs are those of the synchronous order."""
        stashed, self._stash = self._stash, []
        if self.sleeping:
            return _merged(stashed, EngineCoreOutputs([], self.stats(), time.time()))
        self._refuse_bad_grammars()
        flight, self._flight = self._flight, None
        if flight is None:
            flight = self._pipeline.submit(self._schedule({}, 1), None)  # type: ignore[union-attr]
        if async_scheduling.runs_ahead(flight.sched):
            self.scheduler.advance(flight.sched)
            self._flight = self._pipeline.submit(self._schedule({}, 1, wait=False), flight)  # type: ignore[union-attr]
        out = _merged(stashed, self._collect(flight))
        if self._flight is not None and not self.scheduler.has_unfinished():
            # Nothing left to run: the step in flight only decodes sequences that just ended.
            # Waiting for it leaves the engine idle between calls (no forward pass running
            # while the caller, or another engine of the process, goes on).
            last, self._flight = self._flight, None
            out = _merged([out], self._collect(last))
        return out

    def _collect(self, flight: InFlight) -> EngineCoreOutputs:
        """Wait for a submitted step and apply its results."""
        try:
            result = flight.future.result().resolve()
        finally:
            self.structured.finish_step()
        return self._apply(flight.sched, result)

    def _drain(self) -> None:
        """No step in flight from here on (before what the runner must not do mid-step): the
        one in flight is waited for and applied, its outputs kept for the next ``step``."""
        flight, self._flight = getattr(self, "_flight", None), None
        if flight is not None:
            self._stash.append(self._collect(flight))

    def _apply(self, sched: SchedulerOutput, result: ModelOutput) -> EngineCoreOutputs:
        """Apply a step's results: failures, the scheduler's update, then the step's outputs.
        An abandoned step has none: its sequences stay where it found them, to run again."""
        for seq_id, reason in result.failed.items():
            self._fail_seq(sched, seq_id, reason)
        if result.abandoned:
            self.num_abandoned_steps += 1
        updates = [] if result.abandoned else self.scheduler.update(sched, result)
        self._flush_kv_saves()
        self._observe(sched, result)
        if self._loras_to_remove:
            self._remove_unused_loras()
        errors = self.take_errors()
        failed = {e.request_id for e in errors}
        outputs = [self._output(u) for u in updates if u.seq.request_id not in failed]
        for seq, samples in self.scheduler.take_ended():  # deadlines passed (finish reason "timeout")
            outputs.extend(self._ended_outputs(seq, samples))
        stats = self.stats() if result.abandoned else self.stats(sched, _lookahead_tokens(sched, result))
        return EngineCoreOutputs(outputs, stats, time.time(), errors)

    def interrupt_rounds_when(self, arrived: Callable[[], bool] | None) -> None:
        """Let a multi-step round end between its steps once ``arrived()`` is true (the server's
        engine-core process passes "a message is waiting on the input socket"), so a new request
        or an abort waits for one decode step rather than for the rest of a round; None: never."""
        if getattr(self.executor, "runs_lookahead", False):
            self.executor.round_interrupt = arrived  # type: ignore[attr-defined]

    def abandon_background_when(self, arrived: Callable[[], bool] | None) -> None:
        """Let a step made only of background (batch) rows be given up between decoder layers
        once ``arrived()`` is true (the server's engine-core process passes "an interactive
        request came in"), so that request waits for one layer rather than the whole batch
        step; the step's rows run again in a later step, with the same results. None: never.
        Not with async scheduling (the step ahead builds on the one in flight), speculative
        decoding (the proposer's state moves with each step) or a hybrid model (its recurrent
        state is updated in place, layer by layer), nor for executors in other processes.
        Also turns the scheduler's ``background_holdoff`` on (off with None): arrivals between
        steps are what it waits for."""
        self.scheduler.background_holdoff = self.config.scheduler.background_holdoff if arrived is not None else 0.0
        if (self._pipeline is None and self.proposer is None and not self.config.model.is_hybrid
                and hasattr(self.executor, "abandon_background")):
            self.executor.abandon_background = arrived  # type: ignore[attr-defined]

    def background_held_for(self) -> float:
        """Seconds the engine has nothing to run but held-off background work (the caller may
        wait that long for input instead of stepping); 0 otherwise."""
        if self._stash or self._flight is not None or self.sleeping:
            return 0.0
        return self.scheduler.background_held_for()

    def num_steps(self) -> int:
        """Decode steps for the next round (the scheduler runs more than one only for a batch
        of plain decodes with nothing waiting): ``num_scheduler_steps``, or by default as many
        as fit in ``AUTO_STEPS_BURST_S`` at the measured decode-step time, at most
        ``AUTO_MAX_STEPS`` (1 until a decode step has been timed)."""
        if self._steps_fixed is not None:
            return self._steps_fixed
        if self.decode_step_s is None:
            return 1
        return max(1, min(AUTO_MAX_STEPS, int(AUTO_STEPS_BURST_S / max(self.decode_step_s, 1e-6))))

    def _time_decode(self, sched: SchedulerOutput, result: ModelOutput, seconds: float) -> None:
        if not sched.scheduled or sched.num_prefill_tokens or result.failed:
            return
        steps = max(len(r.token_ids) for r in result.results.values()) if result.results else 0
        if steps:
            per_step = seconds / steps
            old = self.decode_step_s
            self.decode_step_s = per_step if old is None else 0.7 * old + 0.3 * per_step

    def _fill_grammar_masks(self, sched: SchedulerOutput) -> None:
        """Structured output: this step's token bitmasks. A request whose mask fails ends alone
        and leaves the batch before the forward pass (its blocks are freed)."""
        failed = self.structured.fill(sched)
        for seq, exc in failed:
            logger.error("request %s: grammar mask failed; ending it alone", seq.request_id, exc_info=exc)
            self.scheduler.fail_request(seq.request, f"{type(exc).__name__}: {exc}")
        if failed:
            gone = {seq.request_id for seq, _ in failed}
            kept = [item for item in sched.scheduled if item.seq.request_id not in gone]
            sched.num_batched_tokens -= sum(i.num_new_tokens for i in sched.scheduled) - sum(
                i.num_new_tokens for i in kept)
            sched.scheduled = kept

    def _refuse_bad_grammars(self) -> None:
        """Requests whose grammar failed to compile end with a 400 naming the problem (the front
        end validates first, so this is a backstop)."""
        for request, message in self.structured.take_failed():
            if self.scheduler.requests.get(request.request_id, [None])[0] is None:
                continue  # aborted meanwhile
            self.scheduler.fail_request(request, message)
            self._refused.append(RequestError(request.request_id, message, 400))

    def _fail_seq(self, sched: SchedulerOutput, seq_id: str, reason: str) -> None:
        for item in sched.scheduled:
            if item.seq.seq_id == seq_id:
                self.scheduler.fail_request(item.seq.request, reason)
                return

    def _propose(self) -> dict[str, Draft]:
        if self.proposer is None:
            return {}
        try:
            return self.proposer.propose(self.scheduler.running, self.scheduler.num_unfinished)
        except Exception:
            # Drafts are an optimisation: without them every sequence decodes normally.
            logger.exception("speculative proposal failed; no drafts this step")
            self.proposer.reset()
            return {}

    def _observe(self, sched: SchedulerOutput, result: ModelOutput) -> None:
        if self.proposer is None:
            return
        try:
            verified = [(item.seq, item.num_draft_tokens) for item in sched.scheduled if item.draft is not None]
            self.proposer.observe(verified, result)
        except Exception:
            logger.exception("speculative bookkeeping failed; its per-sequence state is dropped")
            self.proposer.reset()

    def _ended_outputs(self, seq: Sequence, samples: int) -> list[EngineCoreOutput]:
        """Final outputs of a sequence ended outside a step's update; a prompt that had not forked
        into its ``samples`` yet ends every one of them."""
        first = self._output(SeqUpdate(seq, []))
        return [first] + [msgspec.structs.replace(first, index=seq.sample_index + i, trace_events=None)
                          for i in range(1, samples)]

    def _output(self, u: SeqUpdate) -> EngineCoreOutput:
        """The wire message of one sequence's update. Only fields that differ from their defaults
        are set: the struct (and its encoding) is the same as with every field named, but naming
        all twenty in the call cost ~1 us a sequence a step, where a decode step's usual six cost
        0.2 (``tests/engine/test_core_output.py`` checks it against the all-fields form)."""
        seq, request = u.seq, u.seq.request
        m = request.metrics
        out = EngineCoreOutput(seq.request_id, seq.sample_index, u.new_token_ids, arrival_time=m.arrival_time,
                               first_scheduled_time=m.first_scheduled_time, first_token_time=m.first_token_time)
        if seq.status is SeqStatus.FINISHED:
            out.finish_reason, out.stop_reason, out.finished_time = seq.finish_reason, seq.stop_reason, m.finished_time
        if request.num_cached_tokens:
            out.num_cached_tokens = request.num_cached_tokens
        if seq.params.logprobs is not None:
            out.cumulative_logprob = seq.cumulative_logprob
        if u.new_logprobs is not None:
            out.new_logprobs = u.new_logprobs
        if u.prompt_logprobs is not None:
            out.prompt_logprobs = u.prompt_logprobs
        if u.prompt_ranks is not None:
            out.prompt_ranks = u.prompt_ranks
        if m.num_preemptions:
            out.num_preemptions = m.num_preemptions
        if m.spec_proposed_tokens or m.spec_accepted_tokens:
            out.spec_proposed, out.spec_accepted = m.spec_proposed_tokens, m.spec_accepted_tokens
        if u.embedding is not None:
            out.embedding = u.embedding
        events = request.trace_events
        if events:  # a traced request: its scheduling events so far go with this output
            request.trace_events = []
            out.trace_events = events
        return out

    def stats(self, sched=None, lookahead_tokens: int = 0) -> SchedulerStats:
        s, kv = self.scheduler, self.kv
        proposed = self.proposer.num_proposed if self.proposer else 0
        accepted = self.proposer.num_accepted if self.proposer else 0
        return SchedulerStats(
            num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            prefix_cache_evictions=kv.stats.evictions, num_preemptions=s.num_preemptions,
            step_tokens=sched.num_batched_tokens + lookahead_tokens if sched else 0,
            step_prefill_tokens=sched.num_prefill_tokens if sched else 0,
            spec_proposed=proposed, spec_accepted=accepted,
            prefix_cache_blocks=kv.cache.num_cached if kv.cache else 0, num_abandoned_steps=self.num_abandoned_steps,
            **(self._tenant_stats() if len(s.tenant_requests) > 1 else {}),
            **(self._lora_stats() if self.config.lora is not None else {}),
            **({"kv_offload": self._tier_stats()} if self.kv_store is not None else {}))

    def _tier_stats(self) -> dict[str, int]:
        """The KV tiers' running totals (``SchedulerStats.kv_offload``)."""
        st = self.kv_store.stats  # type: ignore[union-attr]
        out = {"all/miss": st.misses, "all/dropped": st.dropped}
        for tier in self.kv_store.tiers:  # type: ignore[union-attr]
            out[f"{tier.name}/hit"] = st.hits[tier.name]
            out[f"{tier.name}/saved"] = st.saved[tier.name]
            out[f"{tier.name}/error"] = getattr(tier, "errors", 0)
            out[f"{tier.name}/read_bytes"] = st.bytes_read[tier.name]
            out[f"{tier.name}/written_bytes"] = st.bytes_written[tier.name]
            out[f"{tier.name}/read_us"] = int(st.read_s[tier.name] * 1e6)
            out[f"{tier.name}/write_us"] = int(st.write_s[tier.name] * 1e6)
        return out

    def _tenant_stats(self) -> dict[str, dict[str, int]]:
        """Unfinished requests and running sequences of the ``TENANT_STATS_LIMIT`` tenants with
        the most requests; the others' are summed under "other"."""
        named = {t for t, _ in self.scheduler.tenant_requests.most_common(TENANT_STATS_LIMIT)}
        requests: dict[str, int] = {}
        running: dict[str, int] = {}
        for tenant, count in self.scheduler.tenant_requests.items():
            key = tenant if tenant in named else "other"
            requests[key] = requests.get(key, 0) + count
            running.setdefault(key, 0)
        for seq in self.scheduler.running:
            key = seq.request.tenant if seq.request.tenant in named else "other"
            running[key] = running.get(key, 0) + 1
        return {"tenant_requests": requests, "tenant_running_seqs": running}

    def _lora_stats(self) -> dict[str, dict[str, int]]:
        """Requests per adapter name, running and waiting (``pagoda:lora_requests_info``). A
        request counts once however many of its samples (n > 1) are in the queue."""
        out: dict[str, dict[str, int]] = {"running_lora_adapters": {}, "waiting_lora_adapters": {}}
        for key, seqs in (("running_lora_adapters", self.scheduler.running),
                          ("waiting_lora_adapters", self.scheduler.waiting)):
            counts = out[key]
            for request in {id(seq.request): seq.request for seq in seqs}.values():
                lora = request.lora_request
                if lora is not None:
                    counts[lora.lora_name] = counts.get(lora.lora_name, 0) + 1
        return out

    def reset_prefix_cache(self) -> int:
        """Empty the device's prefix cache; with KV tiers its blocks go down to them (the tiers
        keep what they hold)."""
        self._drain()
        freed = self.kv.reset_prefix_cache()
        self._flush_kv_saves()
        return freed

    def shutdown(self) -> None:
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.shutdown()
        structured = getattr(self, "structured", None)
        if structured is not None:
            structured.shutdown()
        store = getattr(self, "kv_store", None)
        if store is not None:
            try:
                self._flush_kv_saves()
            except Exception:  # a tensor-parallel rank gone: those blocks are lost, the rest still stops
                logger.warning("KV tiers: the saves owed at shutdown were not made", exc_info=True)
            store.close()  # finishes the queued writes
        self.executor.shutdown()


def _merged(first: list[EngineCoreOutputs], last: EngineCoreOutputs) -> EngineCoreOutputs:
    """``first`` (steps applied outside ``step``, in order) and ``last`` as one message."""
    if not first:
        return last
    outputs = [o for part in first for o in part.outputs] + last.outputs
    errors = [e for part in first for e in part.errors] + last.errors
    return EngineCoreOutputs(outputs, last.stats, last.timestamp, errors)


def _failure(request_id: str, reason: str) -> RequestError:
    """The error for a request that failed in the engine; ``reason`` is ``describe(exc)``."""
    limit = GrammarLimitError.__name__ + ": "
    if reason.startswith(QUEUE_TIMEOUT_PREFIX):  # its deadline passed while it waited
        return RequestError(request_id, reason.removeprefix(QUEUE_TIMEOUT_PREFIX), 503)
    if reason.startswith(limit):
        return RequestError(request_id, "structured_outputs: " + reason.removeprefix(limit), 400)
    return RequestError(request_id, reason, 500)


# config.json keys that fix the weights' shapes: a new checkpoint must agree on all of them.
_SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings", "quantization_config")


def same_shaped_checkpoint(current: ModelConfig, path: str) -> ModelConfig:
    """``current`` pointing at checkpoint directory ``path``, whose config.json must give the
    same architecture and shapes (``ValueError`` naming the first difference)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path!r} is not a checkpoint directory (no config.json)")
    try:
        new = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} cannot be read: {exc}") from None
    old = current.hf_config
    for key in _SHAPE_KEYS:
        if new.get(key) != old.get(key):
            raise ValueError(f"{path!r} has {key}={new.get(key)!r} but the served model has {old.get(key)!r}; "
                             "update_weights needs the same architecture and shapes")
    return dataclasses.replace(current, path=str(path), hf_config=new)


def _lookahead_tokens(sched: SchedulerOutput, result: ModelOutput) -> int:
    """Tokens a multi-step round ran after its first step (one per sequence per extra step)."""
    n = 0
    for item in sched.scheduled:
        if item.num_lookahead:
            r = result.results.get(item.seq.seq_id)
            n += max(len(r.token_ids) - 1, 0) if r else 0
    return n
