"""Continuous batching with chunked prefill, prefix reuse and preemption by recomputation.

There are no prefill and decode phases: every sequence has ``num_computed_tokens`` and wants to
reach ``num_tokens``. Each step spends a token budget: running decodes first, then prefill
chunks of running sequences, then newly admitted ones. Pure Python: no torch tensors.

With requests of more than one tenant in the engine, a step is scheduled fairly between them
(``_schedule_fair``, shares in ``fair_share.py``); with one tenant the order above is all.
Under the priority policy the queue is in priority order and lower priorities are preempted for
higher ones; deadlines end requests that wait or run too long (``priority.py``). Background
(batch) requests run only in steps with no interactive request in the engine; otherwise the
running ones are paused, and preempted first for an interactive one (``background.py``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Mapping

from pagoda.config import SchedulerConfig
from pagoda.kvcache.manager import KVCacheManager, PrefixMatch
from pagoda.request import Request, Sequence, SeqStatus
from pagoda.scheduler.background import seats, split_background
from pagoda.scheduler.encoder_budget import EncoderBudget
from pagoda.scheduler.fair_share import TenantLoads, heaviest_tenant
from pagoda.step import Draft, ModelOutput, ScheduledSeq, SchedulerOutput, SeqStepResult
from pagoda.scheduler.priority import (QUEUE_TIMEOUT_PREFIX, TIMEOUT_FINISH_REASON, Deadlines, insert_waiting,
                                       preemptible)

logger = logging.getLogger(__name__)

# Async scheduling: the token a sequence will sample in a step still running, held in its token
# list while the next step is scheduled (``Scheduler.advance``); never a real token id.
PLACEHOLDER_TOKEN = -1
_ENDS = -1  # ``Scheduler._ahead``: the step's token ends the sequence (no placeholder)

# The longest-prefix-match policy scans the queue each step; past this length it costs more
# than it saves and the scheduler falls back to arrival order.
LPM_MAX_QUEUE = 128

# A decode step's shortcuts (a one-token decode without chunking arithmetic or an encoder
# charge for a request without images, no sorts when nothing is prefilling). Tests turn them
# off to check each step is scheduled as the general path schedules it.
FAST_PATHS = True


@dataclass
class SeqUpdate:
    """What one step did to one sequence, for the engine to report."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list | None = None
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (it has finished)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 encoder_cached: Callable[[str], bool] | None = None) -> None:
        """``encoder_cached(image_hash)``: whether the runner's encoder cache holds an image's
        features (such an image costs no encoder budget); None: nothing is cached."""
        self.config = config
        self.kv = kv
        self.encoder = EncoderBudget(config.max_num_encoder_tokens_per_step, encoder_cached)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.requests: dict[str, list[Sequence]] = {}
        # Unfinished requests per tenant: more than one key turns on fair sharing.
        self.tenant_requests: Counter[str] = Counter()
        self.num_preemptions = 0
        # Requests ended by a failure of their own since the last ``take_failed``: id -> reason.
        self._failed: dict[str, str] = {}
        # Requests that left ``requests`` since the last ``schedule`` (for the executor).
        self._finished_ids: list[str] = []
        self.by_priority = config.policy == "priority"
        self.deadlines = Deadlines()  # --max-queue-time and requests' own timeouts
        # Sequences a deadline ended outside ``update`` since the last ``take_ended``.
        self._ended: list[tuple[Sequence, int]] = []
        # Unfinished background requests (background.py); fewer than ``requests``: interactive work.
        self.num_background = 0
        # During ``schedule``, with interactive work in the engine: the running background
        # sequences left out of the step (out of ``running``, back in it when the step is built).
        self._paused: list[Sequence] = []
        # Seconds background requests stay paused once interactive work ends (0: none; set by
        # the server's engine core), and the ``time.monotonic()`` until which they are held.
        self.background_holdoff = 0.0
        self._hold_until = 0.0
        # Async scheduling: sequences of the step ``advance`` ran ahead of, by id: (the sequence,
        # its request's preemption count then, the index of its placeholder token or None).
        self._ahead: dict[str, tuple[Sequence, int, int | None]] = {}

    # ---- intake --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request. ``n > 1`` starts as one sequence that forks after its prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        seq = Sequence(f"{request.request_id}#0", request, list(request.prompt_token_ids),
                       num_samples=request.params.n)
        self.requests[request.request_id] = [seq]
        self.tenant_requests[request.tenant] += 1
        self.num_background += request.background
        if self.by_priority:
            insert_waiting(self.waiting, seq)
        else:
            self.waiting.append(seq)
        self.kv.prefetch(seq)  # its blocks in the KV tiers are read while it waits
        if self.config.max_queue_time is not None:
            self.deadlines.add(request.arrival_time + self.config.max_queue_time, "queue", request)
        if request.deadline is not None:
            self.deadlines.add(request.deadline, "end", request)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of a request now and free its blocks. Unknown ids are ignored."""
        seqs = self.requests.pop(request_id, [])
        if seqs:
            self._finished_ids.append(request_id)
            self._forget_tenant(seqs[0].request)
        for seq in seqs:
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status == SeqStatus.RUNNING:
                self.running.remove(seq)
                self.kv.free(seq)
            if not seq.finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        return seqs

    def fail_request(self, request: Request, reason: str) -> None:
        """End every sequence of ``request`` (finish reason "error") and free its blocks,
        whatever half-done state the failure left them in (e.g. mid-fork, before the request's
        sequence list was updated). The reason is kept for ``take_failed``."""
        known = self.requests.pop(request.request_id, [])
        if known:
            self._forget_tenant(known[0].request)
        seqs = {id(s): s for s in known if s.request is request}
        self._finished_ids.append(request.request_id)
        seqs.update({id(s): s for s in (*self.waiting, *self.running) if s.request is request})
        for seq in seqs.values():
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in self.running:
                self.running.remove(seq)
            self.kv.free(seq)
            # Samples that had already finished fail too: the request is reported as one error.
            seq.status, seq.finish_reason, seq.stop_reason = SeqStatus.FINISHED, "error", None
        request.metrics.finished_time = time.time()
        self._failed.setdefault(request.request_id, reason)

    def _forget_tenant(self, request: Request) -> None:
        """``request`` left ``requests``: its tenant has one unfinished request fewer (and the
        background class, if it was one)."""
        self.num_background -= request.background
        if not request.background and self.background_holdoff and not self.interactive_waiting_or_running:
            self._hold_until = time.monotonic() + self.background_holdoff  # the last interactive one left
        left = self.tenant_requests[request.tenant] - 1
        if left > 0:
            self.tenant_requests[request.tenant] = left
        else:
            self.tenant_requests.pop(request.tenant, None)

    def take_failed(self) -> dict[str, str]:
        """Requests failed since the last call (id -> reason), to report once."""
        failed, self._failed = self._failed, {}
        return failed

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, Draft] | None = None, num_steps: int = 1) -> SchedulerOutput:
        """This step's batch. ``drafts`` (seq id -> proposal) are run after their running decode
        sequence's last token when the budget has room for all of them, else dropped. With
        ``num_steps`` > 1 a batch of decodes only, none waiting behind it, runs up to that many
        decode steps in a row (``_look_ahead``)."""
        drafts = drafts or {}
        if self.deadlines:
            self._expire(time.time())
        budget = [self.config.max_num_batched_tokens]
        self.encoder.reset()
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[Sequence] = []
        # Seats given back by paused background sequences: not memory pressure, admission goes on.
        unseated = self._pause_background()
        try:
            if len(self.tenant_requests) > 1:
                self._schedule_fair(drafts, budget, scheduled, preempted)
            else:
                # Decodes first, then running prefills; within each group, admission order (a
                # stable partition, one pass when nothing is prefilling: a decode step's case).
                running = self.running
                if FAST_PATHS:
                    order = [s for s in running if len(s.token_ids) - s.num_computed_tokens <= 1]
                    if len(order) < len(running):
                        order += [s for s in running if len(s.token_ids) - s.num_computed_tokens > 1]
                else:
                    order = sorted(running, key=lambda s: s.is_prefilling)
                for seq in order:
                    if seq.status is not SeqStatus.RUNNING or budget[0] <= 0:
                        continue
                    self._schedule_running(seq, drafts.get(seq.seq_id), budget, scheduled, preempted)
                if not preempted or self.by_priority:
                    self._admit_waiting(budget, scheduled, preempted)
        finally:
            # Paused sequences go back last: the newest running ones, preempted first next time.
            self.running.extend(self._paused)
            self._paused = []
        preempted = unseated + preempted
        ordered = [scheduled[s.seq_id] for s in self.running if s.seq_id in scheduled]
        # Each item runs at least one token and the budget spent is their sum, so a step that
        # spent one a sequence has only one-token decodes: nothing to move.
        if self.config.max_num_batched_tokens - budget[0] > len(ordered) or not FAST_PATHS:
            ordered.sort(key=lambda s: s.num_new_tokens - s.num_draft_tokens > 1)
        if num_steps > 1 and ordered and not self.waiting and not preempted:
            self._look_ahead(ordered, num_steps)
        now = time.time()
        for item in ordered:
            request = item.seq.request
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if request.trace_events is not None and item.start < item.seq.num_tokens - 1:  # a prompt chunk
                request.trace_events.append(("prefill_chunk", now, item.start, item.num_new_tokens))
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(ordered, self.config.max_num_batched_tokens - budget[0],
                               self.kv.take_copies(), preempted, finished, self.kv.take_transfers(),
                               self.kv.take_state_copies())

    @property
    def interactive_waiting_or_running(self) -> bool:
        """Whether an interactive (not background) request is unfinished in the engine."""
        return len(self.requests) > self.num_background

    def background_held_for(self) -> float:
        """Seconds until held-off background work may run, when it is all the engine has
        (``background_holdoff`` after the last interactive request left); else 0."""
        if not self.num_background or self.interactive_waiting_or_running:
            return 0.0
        return max(0.0, self._hold_until - time.monotonic())

    def _pause_background(self) -> list[Sequence]:
        """With interactive work in the engine, or within ``background_holdoff`` of its end, take
        the running background sequences out of ``running`` into ``_paused`` for this step, and
        preempt paused ones (newest first) until the sequence slots hold every running and
        waiting interactive sequence beside them. Returns those preempted."""
        if not self.num_background or not (self.interactive_waiting_or_running or self.background_held_for()):
            return []
        self.running, self._paused = split_background(self.running)
        unseated: list[Sequence] = []
        if not self._paused:
            return unseated
        wanted = seats(s for s in self.waiting if not s.request.background)
        while self._paused and seats(self.running) + seats(self._paused) + wanted > self.config.max_num_seqs:
            unseated.append(self._paused[-1])
            self._preempt(self._paused[-1])
        return unseated

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """How many of ``remaining`` tokens to run now; 0 if the sequence must wait. A prompt
        chunk also stops before an image whose encoding passes the step's encoder budget."""
        if remaining <= 1:
            return min(remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        start = seq.num_tokens - remaining
        if not self.config.enable_chunked_prefill and seq.num_output_tokens == 0:
            # Whole prompts only; one whose images pass the encoder budget runs as the step's
            # first encoder work (else it would never run).
            if remaining > budget or (self.encoder.used
                                      and self.encoder.cap(seq.request, start, seq.num_tokens) < seq.num_tokens):
                return 0
            return remaining
        n = min(remaining, budget)
        n = min(n, threshold) if threshold > 0 else n
        return self.encoder.cap(seq.request, start, start + n) - start

    def _schedule_running(self, seq: Sequence, draft: Draft | None, budget: list[int],
                          scheduled: dict[str, ScheduledSeq], preempted: list[Sequence],
                          loads: TenantLoads | None = None) -> None:
        start = seq.num_computed_tokens
        remaining = len(seq.token_ids) - start
        if remaining == 1 and draft is None and budget[0] > 0 and FAST_PATHS:
            n = 1  # a decode: what ``_chunk`` gives one token with room in the budget
        elif draft is not None and draft.k and remaining == 1 and budget[0] >= 1 + draft.k:
            n = 1 + draft.k
        else:
            draft = None
            n = self._chunk(seq, remaining, budget[0])
            if n == 0:
                return
        while not self.kv.allocate(seq, n):
            victim = self._pick_victim(scheduled, budget, loads)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return
        scheduled[seq.seq_id] = ScheduledSeq(seq, start, n, draft)
        if seq.request.images or not FAST_PATHS:  # (``charge`` books nothing without images)
            self.encoder.charge(seq.seq_id, seq.request, start, start + n)
        budget[0] -= n

    def _look_ahead(self, items: list[ScheduledSeq], num_steps: int) -> None:
        """Multi-step decoding: give every item ``steps - 1`` lookahead decode steps, the same for
        all, where each is a one-token decode that samples without anything that reads the tokens
        of the steps in between (logprobs, penalties, a pending min_tokens, a grammar, LoRA, drafts,
        a fork into samples) and without a logit bias or allowed ids (the CPU round takes the raw argmax).
        ``steps`` stops at the nearest max_tokens / max_model_len, so no
        sequence runs past its end. Blocks for the extra tokens come from free memory only: where
        any is short the step stays single (a lookahead never preempts anyone)."""
        steps = num_steps
        for item in items:
            seq, params = item.seq, item.seq.params
            if (item.num_new_tokens != 1 or item.draft is not None or seq.num_samples != 1
                    or seq.num_output_tokens < max(params.min_tokens, 1) or params.logprobs is not None
                    or params.needs_penalties or params.edits_logits or seq.request.grammar is not None
                    or seq.request.lora_request is not None or seq.request.images):
                return  # (images: their decode positions are not their cache positions)
            if params.max_tokens is not None:
                steps = min(steps, params.max_tokens - seq.num_output_tokens)
            steps = min(steps, self.config.max_model_len - seq.num_tokens)
        if steps < 2:
            return
        for item in items:
            if not self.kv.allocate(item.seq, steps):
                return  # extra blocks given to earlier items are trimmed at their update
        for item in items:
            item.num_lookahead = steps - 1

    def _pick_victim(self, scheduled: dict[str, ScheduledSeq], budget: list[int],
                     loads: TenantLoads | None = None) -> Sequence:
        """The newest paused background sequence, if any (it is not in the step); else the
        newest running sequence; with tenants (``loads``), the newest of the tenant whose running
        sequences hold the most blocks."""
        if self._paused:
            return self._paused[-1]
        victim = self.running[-1]
        if self.by_priority:  # the lowest priority's newest (the needy sequence itself, if it is that)
            victim = max(reversed(self.running), key=lambda s: s.request.priority)
        if loads is not None:
            tenant = heaviest_tenant(self.running)
            victim = next(s for s in reversed(self.running) if s.request.tenant == tenant)
            loads.remove(victim)
        item = scheduled.pop(victim.seq_id, None)
        if item is not None:
            budget[0] += item.num_new_tokens
            self.encoder.refund(victim.seq_id)
        return victim

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens, go back to the front of the queue."""
        if self._paused and seq in self._paused:
            self._paused.remove(seq)
        else:
            self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if seq.request.trace_events is not None:
            seq.request.trace_events.append(("preempted", time.time(), 0, 0))
        if self.by_priority:
            insert_waiting(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)

    def preempt_all(self) -> int:
        """Preempt every running sequence (the KV cache is about to go: sleep, new weights);
        they run again from their tokens, in their order. Returns how many."""
        running = list(self.running)
        for seq in reversed(running):
            self._preempt(seq)
        return len(running)

    def _admit_waiting(self, budget: list[int], scheduled: dict[str, ScheduledSeq],
                       preempted: list[Sequence]) -> None:
        """Start waiting sequences in queue order while the budget, slots and blocks last; under
        the priority policy a sequence short of a slot or block preempts lower-priority ones."""
        if not self.waiting:
            return
        deferred: list[Sequence] = []
        adapters = self._running_adapters()
        slots = self._num_slots()
        while self.waiting and budget[0] > 0:
            seq = self._next_waiting()
            if (seq.request.grammar is not None and not seq.request.grammar.ready) or self._held_back(seq):
                # Its grammar is still compiling (off the step loop), or it is background work
                # while interactive work is in the engine: the others go ahead.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            if slots + seq.num_samples > self.config.max_num_seqs and self.running and not self.by_priority:
                break
            lora = seq.request.lora_request
            if lora is not None and lora not in adapters and len(adapters) >= self.config.max_loras:
                # Every adapter slot is taken by running requests: this one waits for a slot,
                # later requests of the running adapters (or the base model) may go ahead.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            prefix = self.kv.extend_from_tiers(seq, self.kv.match_prefix(seq))
            if prefix is None or self._shares_block_in_flight(seq, prefix.num_tokens):
                # Its blocks are loading from a KV tier (the step goes on without it), or
                # another sequence is computing this prompt's next block right now: wait a step
                # and reuse it from the cache instead of computing the same KV twice.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            # (Under the priority policy a full batch is checked here, once the sequence is sure to
            # start if it gets a slot: nobody is preempted for a sequence that would wait anyway.)
            while slots + seq.num_samples > self.config.max_num_seqs and self.running:
                if not self._preempt_lower(seq, budget, scheduled, preempted):
                    break
                slots = self._num_slots()
            if slots + seq.num_samples > self.config.max_num_seqs and self.running:
                break
            n = self._chunk(seq, seq.num_tokens - prefix.num_tokens, budget[0])
            if n == 0 and self.encoder.blocks(seq.request, prefix.num_tokens):
                # Its next image's encoding does not fit this step: later requests (text ones,
                # or ones with cached images) go ahead; it keeps its place for the next step.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            if n == 0 or not self._allocate_or_preempt(seq, n, prefix, budget, scheduled, preempted):
                break
            self._start(seq, prefix, n, budget, scheduled)
            slots += seq.num_samples
            if lora is not None:
                adapters.add(lora)
        if self.by_priority:
            for seq in deferred:
                insert_waiting(self.waiting, seq)
        else:
            self.waiting.extendleft(reversed(deferred))

    def _allocate_or_preempt(self, seq: Sequence, n: int, prefix: PrefixMatch, budget: list[int],
                             scheduled: dict[str, ScheduledSeq], preempted: list[Sequence]) -> bool:
        """Blocks for ``n`` tokens of a waiting ``seq``, preempting lower-priority sequences for
        them under the priority policy; False if they cannot be had."""
        while not self.kv.allocate(seq, n, prefix):
            if not self._preempt_lower(seq, budget, scheduled, preempted):
                return False
        return True

    def _preempt_lower(self, seq: Sequence, budget: list[int], scheduled: dict[str, ScheduledSeq],
                       preempted: list[Sequence]) -> bool:
        """Preempt a paused background sequence for an interactive waiting ``seq``; else, under
        the priority policy, the running sequence ``preemptible`` names (giving back its share of
        this step's budget); False if none."""
        if self._paused and not seq.request.background:
            victim: Sequence | None = self._paused[-1]
        else:
            victim = preemptible(self.running, seq.request.priority) if self.by_priority else None
        if victim is None:
            return False
        self._evict(victim, budget, scheduled, preempted)
        return True

    def _evict(self, victim: Sequence, budget: list[int], scheduled: dict[str, ScheduledSeq],
               preempted: list[Sequence]) -> None:
        """Preempt running ``victim`` for a waiting request: its share of this step's token
        budget (if it was scheduled) goes back, and it joins the step's ``preempted``."""
        item = scheduled.pop(victim.seq_id, None)
        if item is not None:
            budget[0] += item.num_new_tokens
            self.encoder.refund(victim.seq_id)
        self._preempt(victim)
        preempted.append(victim)

    # ---- deadlines -----------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Deadlines that have passed: a request that has not started fails (a 503 for the
        client, ``QUEUE_TIMEOUT_PREFIX``); a started one past its own deadline ends, every
        unfinished sample with finish reason "timeout" (reported by ``take_ended``)."""
        for kind, request in self.deadlines.due(now):
            seqs = self.requests.get(request.request_id)
            if not seqs or seqs[0].request is not request:
                continue  # it has finished already (and its id may have been reused)
            if request.metrics.first_scheduled_time is None:
                limit = "its timeout" if kind == "end" else f"max_queue_time {self.config.max_queue_time:g} s"
                self.fail_request(request, f"{QUEUE_TIMEOUT_PREFIX}the request waited "
                                           f"{now - request.arrival_time:.2f} s without starting ({limit}); "
                                           "retry later")
            elif kind == "end":
                for seq in list(seqs):
                    if not seq.finished:
                        samples, seq.num_samples = seq.num_samples, 1  # a prompt not yet forked ends as all n
                        self.finish_sequence(seq, TIMEOUT_FINISH_REASON)
                        self._ended.append((seq, samples))

    def take_ended(self) -> list[tuple[Sequence, int]]:
        """Sequences a deadline ended since the last call, each with the number of samples it
        stands for (``n`` for a prompt that had not forked yet), to report once."""
        ended, self._ended = self._ended, []
        return ended

    def _start(self, seq: Sequence, prefix: PrefixMatch, n: int, budget: list[int],
               scheduled: dict[str, ScheduledSeq]) -> None:
        """Move an admitted ``seq`` (its blocks allocated) from waiting to running with ``n`` tokens."""
        self.waiting.remove(seq)
        if seq.num_output_tokens == 0 and seq.request.metrics.num_preemptions == 0:
            self.kv.record_query(seq.num_tokens, prefix.num_tokens)
            seq.request.num_cached_tokens = prefix.num_tokens
        seq.num_computed_tokens = prefix.num_tokens
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        scheduled[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, n)
        self.encoder.charge(seq.seq_id, seq.request, seq.num_computed_tokens, seq.num_computed_tokens + n)
        budget[0] -= n

    def _num_slots(self) -> int:
        """Sequence slots the running sequences hold, paused ones included: a prompt still to
        fork into ``n`` samples holds ``n`` (its samples will run), so ``max_num_seqs`` bounds the
        batch after forks too."""
        return seats(self.running) + seats(self._paused)

    def _held_back(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` is background work in a step with interactive work (or
        within ``background_holdoff`` of its end)."""
        return seq.request.background and (self.interactive_waiting_or_running or self.background_held_for() > 0)

    def _running_adapters(self) -> set:
        """The distinct LoRA adapters of running sequences: a step holds at most ``max_loras``."""
        if not self.config.max_loras:
            return set()
        return {s.request.lora_request for s in self.running if s.request.lora_request is not None}

    # ---- fair shares between tenants ------------------------------------------------------
    def _schedule_fair(self, drafts: Mapping[str, Draft], budget: list[int], scheduled: dict[str, ScheduledSeq],
                       preempted: list[Sequence]) -> None:
        """A step with requests of several tenants: decodes first (each tenant's are bounded by
        its slots, and with ``fair_step_share`` by its share of the step:
        ``TenantLoads.step_share``); then prefill tokens, first each tenant up to an equal part of
        what is left (its running prefills, then its waiting sequences), then whatever remains in the same
        order. A preemption picks the newest sequence of the tenant holding the most blocks;
        admission goes tenant by tenant, the least loaded first (``_admit_fair``)."""
        loads = TenantLoads(self.running, self.tenant_requests, self.config.max_num_seqs, self.kv.num_blocks)
        prefills = [s for s in self.running if s.is_prefilling]
        decodes = [s for s in self.running if not s.is_prefilling]
        if self.config.fair_step_share:
            decodes = loads.step_share(decodes)
        for seq in decodes:
            if seq.status == SeqStatus.RUNNING and budget[0] > 0:
                self._schedule_running(seq, drafts.get(seq.seq_id), budget, scheduled, preempted, loads)
        part = -(-budget[0] // len(loads.tenants))
        quota: Counter[str] = Counter({t: part for t in loads.tenants})
        for capped in (quota, None):
            for seq in prefills:
                self._schedule_prefill(seq, budget, capped, scheduled, preempted, loads)
            self._admit_fair(budget, capped, scheduled, preempted, loads)
            # The second round also lengthens the chunks of sequences the first one admitted.
            prefills = [s for s in self.running if s.is_prefilling]

    def _schedule_prefill(self, seq: Sequence, budget: list[int], quota: Counter | None,
                          scheduled: dict[str, ScheduledSeq], preempted: list[Sequence], loads: TenantLoads) -> None:
        """Schedule (or lengthen) a running prefill's chunk within ``budget`` and its tenant's ``quota``."""
        tenant = seq.request.tenant
        limit = budget[0] if quota is None else min(budget[0], quota[tenant])
        if seq.status != SeqStatus.RUNNING or limit <= 0:
            return
        item = scheduled.get(seq.seq_id)
        if item is None:
            local = [limit]
            self._schedule_running(seq, None, local, scheduled, preempted, loads)
            used = limit - local[0]
        else:
            used = self._lengthen(item, limit)
        budget[0] -= used
        if quota is not None:
            quota[tenant] -= used

    def _lengthen(self, item: ScheduledSeq, limit: int) -> int:
        """Add up to ``limit`` tokens to a prefill chunk scheduled earlier in this step (from
        free blocks only); returns how many were added."""
        seq = item.seq
        if item.draft is not None or item.samples:
            return 0
        n = self._chunk(seq, seq.num_tokens - item.end, limit)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            n = min(n, threshold - item.num_new_tokens)
        if n <= 0 or not self.kv.allocate(seq, item.num_new_tokens + n):
            return 0
        self.encoder.charge(seq.seq_id, seq.request, item.end, item.end + n)
        item.num_new_tokens += n
        return n

    def _admit_fair(self, budget: list[int], quota: Counter | None, scheduled: dict[str, ScheduledSeq],
                    preempted: list[Sequence], loads: TenantLoads) -> None:
        """Admit waiting sequences tenant by tenant, the one holding the fewest slots first, each
        in queue order. A tenant whose next sequence cannot start waits this step (the others
        go on): no tenant's queue holds up another's."""
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.request.tenant, deque()).append(seq)
        order = {t: i for i, t in enumerate(queues)}
        adapters = self._running_adapters()
        while budget[0] > 0:
            ready = [t for t, q in queues.items() if q and (quota is None or quota[t] > 0)]
            if not ready:
                return
            tenant = min(ready, key=lambda t: (loads.seqs[t], order[t]))
            seq = queues[tenant].popleft()
            limit = budget[0] if quota is None else min(budget[0], quota[tenant])
            n = self._admit_one(seq, limit, budget, scheduled, preempted, loads, adapters)
            if n is None:
                queues[tenant].clear()  # out of slots or blocks for this tenant this step
            elif quota is not None:
                quota[tenant] -= n

    def _admit_one(self, seq: Sequence, limit: int, budget: list[int], scheduled: dict[str, ScheduledSeq],
                   preempted: list[Sequence], loads: TenantLoads, adapters: set) -> int | None:
        """Try to start ``seq`` with at most ``limit`` tokens. Returns the tokens scheduled (0:
        it waits, later sequences of its tenant may go), or None: its tenant waits this step.
        A tenant within its share of slots takes a missing slot or block from the tenant
        furthest over its share; once anything was preempted this step, only such tenants start."""
        lora = seq.request.lora_request
        if (seq.request.grammar is not None and not seq.request.grammar.ready) or self._held_back(seq):
            return 0
        if lora is not None and lora not in adapters and len(adapters) >= self.config.max_loras:
            return 0
        tenant = seq.request.tenant
        fair = loads.within_share(tenant, seq.num_samples)
        if preempted and not fair:
            return None
        prefix = self.kv.extend_from_tiers(seq, self.kv.match_prefix(seq))
        if prefix is None or self._shares_block_in_flight(seq, prefix.num_tokens):
            return 0
        while loads.num_slots + seq.num_samples > self.config.max_num_seqs and self.running:
            if not fair or not self._preempt_for(tenant, "seqs", budget, scheduled, preempted, loads):
                return None
        n = self._chunk(seq, seq.num_tokens - prefix.num_tokens, min(limit, budget[0]))
        if n == 0:
            # An image that does not fit the encoder budget holds up only this sequence.
            return 0 if self.encoder.blocks(seq.request, prefix.num_tokens) else None
        while not self.kv.allocate(seq, n, prefix):
            if self._paused and not seq.request.background:
                self._evict(self._paused[-1], budget, scheduled, preempted)
            elif (not fair or not loads.within_block_share(self.running, seq, self.kv.block_size)
                  or not self._preempt_for(tenant, "blocks", budget, scheduled, preempted, loads)):
                return None
        self._start(seq, prefix, n, budget, scheduled)
        loads.add(seq)
        if lora is not None:
            adapters.add(lora)
        return n

    def _preempt_for(self, tenant: str, resource: str, budget: list[int], scheduled: dict[str, ScheduledSeq],
                     preempted: list[Sequence], loads: TenantLoads) -> bool:
        """Preempt the newest sequence of the tenant (not ``tenant``) furthest over its share of
        ``resource`` ("seqs" or "blocks"); False if no tenant is over its share."""
        victim_tenant = loads.over_share(self.running, resource, exclude=tenant)  # type: ignore[arg-type]
        if victim_tenant is None:
            return False
        victim = next((s for s in reversed(self.running) if s.request.tenant == victim_tenant), None)
        if victim is None:
            return False
        loads.remove(victim)
        self._evict(victim, budget, scheduled, preempted)
        return True

    def _shares_block_in_flight(self, seq: Sequence, num_cached: int) -> bool:
        """True if a running sequence of the same cache namespace (adapter and salt: another
        namespace's block would never be shared, and waiting on it would tell one tenant about
        another's prompt) has the same tokens up to the end of ``seq``'s first uncached block
        and has not finished computing that block yet."""
        if self.kv.cache is None:
            return False
        end = num_cached + self.kv.block_size
        if end > seq.num_tokens - 1:
            return False
        head, namespace = seq.cache_key_ids[:end], seq.request.cache_namespace
        return any(other.num_computed_tokens < end <= other.num_tokens and other.cache_key_ids[:end] == head
                   and other.request.cache_namespace == namespace for other in self.running if other.is_prefilling)

    def _next_waiting(self) -> Sequence:
        if self.config.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            # Preempted sequences keep their place at the front.
            if self.waiting[0].request.metrics.num_preemptions == 0:
                return max(self.waiting, key=lambda s: self.kv.match_prefix(s).num_tokens)
        return self.waiting[0]

    # ---- async scheduling ----------------------------------------------------------------
    def advance(self, sched: SchedulerOutput) -> None:
        """Async scheduling: before ``sched``'s results are in, apply what its ``update`` will do
        for sure, so that the next ``schedule`` sees each sequence where it will be: its chunk
        computed, and a sequence that samples one ``PLACEHOLDER_TOKEN`` longer (the next step
        decodes it; the runner writes the sampled id in its place). ``update`` then takes it back
        and applies the real results as if the step had been scheduled alone. Only for steps
        without drafts, lookahead or a prompt forking into samples (``engine.async_scheduling``)."""
        for item in sched.scheduled:
            seq = item.seq
            if seq.status != SeqStatus.RUNNING:
                continue
            samples = item.samples
            seq.num_computed_tokens = item.end
            index = None
            if samples and self._ends_by_length(seq):
                index = _ENDS  # its token ends it: no decode after it (nothing left to compute)
            elif samples:
                index = len(seq.token_ids)
                seq.token_ids.append(PLACEHOLDER_TOKEN)
            self._ahead[seq.seq_id] = (seq, seq.request.metrics.num_preemptions, index)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token ``seq`` samples next ends it by max_tokens or max_model_len."""
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens)
                or seq.num_tokens + 1 >= self.config.max_model_len)

    def _take_ahead(self, item: ScheduledSeq, result: SeqStepResult | None,
                    now: float) -> list[SeqUpdate] | None:
        """The update of an item ``advance`` ran ahead of; None: the ordinary update applies
        (its placeholder is gone). A sequence preempted since (by the step scheduled ahead) keeps
        its progress as the preemption left it, and only gets its token."""
        seq, preemptions, index = self._ahead.pop(item.seq.seq_id, (None, 0, None))
        if seq is not item.seq:
            return None
        moved = seq.request.metrics.num_preemptions != preemptions
        placeholder = index is not None and index != _ENDS
        if not moved or seq.status == SeqStatus.FINISHED:
            if placeholder and seq.token_ids[index:] == [PLACEHOLDER_TOKEN]:
                seq.token_ids.pop()
            return None  # (a sequence aborted, ended or failed meanwhile is skipped there)
        if index is None or not (result and result.token_ids):
            return []  # a prompt chunk: the preemption dropped its progress anyway
        return [self._fill_placeholder(seq, index if placeholder else None, result, now)]

    def _fill_placeholder(self, seq: Sequence, index: int | None, result: SeqStepResult,
                          now: float) -> SeqUpdate:
        """The sampled token of a sequence preempted after its step was scheduled: written where
        its placeholder is (the recomputation may already run it; ``index`` None: appended, the
        token ends it), stops checked as usual."""
        token = result.token_ids[0]
        if index is None:
            seq.token_ids.append(token)
        else:
            seq.token_ids[index] = token
        if result.token_logprobs is not None:
            seq.cumulative_logprob += result.token_logprobs[0]
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        status = seq.status
        if self._check_stop(seq, token):
            reason = seq.finish_reason or "stop"
            seq.status = status  # finish_sequence takes it out of the queue or the batch
            self.finish_sequence(seq, reason, seq.stop_reason)
        return SeqUpdate(seq, [token], result.logprobs[:1] if result.logprobs is not None else None)

    # ---- results -------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, output: ModelOutput) -> list[SeqUpdate]:
        """Apply a step's results: advance progress, append tokens, check stops, free blocks.

        A sequence whose update raises ends its request alone (``fail_request``); the updates
        of a failed request are dropped, everyone else's are returned."""
        updates: list[SeqUpdate] = []
        now = time.time()
        for item in sched.scheduled:
            seq = item.seq
            if self._ahead:
                try:
                    taken = self._take_ahead(item, output.results.get(seq.seq_id), now)
                except Exception as exc:
                    logger.error("request %s failed in the scheduler update; ending it alone", seq.request_id,
                                 exc_info=exc)
                    self.fail_request(seq.request, f"{type(exc).__name__}: {exc}")
                    continue
                if taken is not None:
                    updates.extend(taken)
                    continue
            if seq.status != SeqStatus.RUNNING:
                continue  # aborted while the step ran, or failed
            try:
                updates.extend(self._update_seq(item, output.results.get(seq.seq_id), now))
            except Exception as exc:
                logger.error("request %s failed in the scheduler update; ending it alone", seq.request_id,
                             exc_info=exc)
                self.fail_request(seq.request, f"{type(exc).__name__}: {exc}")
        self._ahead.clear()
        return [u for u in updates if u.seq.finish_reason != "error"]

    def _update_seq(self, item: ScheduledSeq, result: SeqStepResult | None, now: float) -> list[SeqUpdate]:
        seq = item.seq
        computed = item.start + item.num_new_tokens - item.num_draft_tokens
        if result is not None:
            computed += result.num_draft_accepted
            if item.num_lookahead and len(result.token_ids) > 1:
                computed += len(result.token_ids) - 1  # lookahead steps computed all but the last token's K/V
        seq.num_computed_tokens = computed
        self.kv.release_outside_window(seq)
        if result is None:
            self.kv.cache_blocks(seq)
            return []
        if result.prompt_logprobs is not None:
            seq.request.prompt_logprobs.extend(result.prompt_logprobs)
        if result.embedding is not None:
            return [self._finish_pooled(seq, result.embedding, now)]
        if not result.token_ids:
            self.kv.cache_blocks(seq)
            if result.prompt_logprobs is None:
                return []
            return [SeqUpdate(seq, [], None, result.prompt_logprobs, result.prompt_ranks)]
        if seq.num_samples <= 1:  # (the common case: one sample's tokens, nothing to fork)
            update = self._append(seq, result.token_ids, result, None, now)
            update.prompt_logprobs, update.prompt_ranks = result.prompt_logprobs, result.prompt_ranks
            return [update]
        targets = self._fork(seq, len(result.token_ids))
        updates = []
        for i, target in enumerate(targets):
            tokens = result.token_ids[i:i + 1] if len(targets) > 1 else result.token_ids
            updates.append(self._append(target, tokens, result, i if len(targets) > 1 else None, now))
        # Prompt logprobs are the request's, reported once with its first sample.
        updates[0].prompt_logprobs, updates[0].prompt_ranks = result.prompt_logprobs, result.prompt_ranks
        return updates

    def _finish_pooled(self, seq: Sequence, embedding: list[float], now: float) -> SeqUpdate:
        """An embedding request ends with its prefill: no token is sampled or appended."""
        self.kv.cache_blocks(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "stop"
        seq.request.metrics.first_token_time = seq.request.metrics.last_token_time = now
        self._finish(seq)
        return SeqUpdate(seq, [], embedding=embedding)

    def _fork(self, parent: Sequence, n: int) -> list[Sequence]:
        """Split a finished prompt into its ``n`` samples, sharing every block (copy on write)."""
        parent.num_samples = 1
        seqs = [parent]
        request = parent.request
        for i in range(1, n):
            child = Sequence(f"{request.request_id}#{i}", request, list(parent.token_ids), sample_index=i)
            if parent.grammar is not None:
                child.grammar = parent.grammar.fork()  # each sample follows the grammar on its own
            self.kv.fork(parent, child)
            child.status = SeqStatus.RUNNING
            self.running.insert(self.running.index(seqs[-1]) + 1, child)
            seqs.append(child)
        self.requests[request.request_id] = seqs
        return seqs

    def _append(self, seq: Sequence, tokens: list[int], result: SeqStepResult, index: int | None,
                now: float) -> SeqUpdate:
        new_tokens: list[int] = []
        grammar, token_ids = seq.grammar, seq.token_ids
        all_logprobs, token_logprobs = result.logprobs, result.token_logprobs
        logprobs = [] if all_logprobs is not None else None
        for j, token in enumerate(tokens):
            src = j if index is None else index
            if grammar is not None and not grammar.accept(token):
                raise ValueError(f"the grammar refused token {token}")  # the mask makes this a bug
            token_ids.append(token)
            new_tokens.append(token)
            if logprobs is not None:
                logprobs.append(all_logprobs[src])
            if token_logprobs is not None:
                seq.cumulative_logprob += token_logprobs[src]
            if self._check_stop(seq, token):
                break
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        self.kv.cache_blocks(seq)
        if seq.status is SeqStatus.FINISHED:
            self._finish(seq)
        else:
            # A rejected speculative tail or a stop may leave blocks past what is needed.
            self.kv.trim(seq, len(token_ids))
        return SeqUpdate(seq, new_tokens, logprobs)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        produced = len(seq.token_ids) - seq.num_prompt_tokens
        reason: str | None = None
        if produced >= params.min_tokens:
            if token in params.stop_token_ids:
                reason, seq.stop_reason = "stop", token
            elif not params.ignore_eos and token in seq.request.eos_token_ids:
                reason = "stop"
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"  # the grammar is complete and allows nothing more
        if reason is None and params.max_tokens is not None and produced >= params.max_tokens:
            reason = "length"
        if reason is None and len(seq.token_ids) >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        return reason is not None

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence from outside the token checks (a stop string found by detokenizing).
        A waiting sequence (preempted, waiting to be recomputed) ends too: it leaves the queue."""
        if seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status != SeqStatus.RUNNING:
            return
        seq.status, seq.finish_reason, seq.stop_reason = SeqStatus.FINISHED, reason, stop_reason
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq in self.running:  # a waiting sequence ended by ``finish_sequence`` is not
            self.running.remove(seq)
        seq.request.metrics.finished_time = time.time()
        seqs = self.requests.get(seq.request_id, [])
        if all(s.finished for s in seqs) and seq.num_samples <= 1:
            if self.requests.pop(seq.request_id, None) is not None:
                self._finished_ids.append(seq.request_id)
                self._forget_tenant(seq.request)
