"""Continuous batching with chunked prefill, prefix reuse and preemption by recomputation.

There are no prefill and decode phases: every sequence has ``num_computed_tokens`` and wants to
reach ``num_tokens``. Each step spends a token budget: running decodes first, then prefill
chunks of running sequences, then newly admitted ones. Pure Python: no torch tensors.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping

from pagoda.config import SchedulerConfig
from pagoda.executor.output import Draft, ModelOutput, SeqStepResult
from pagoda.kvcache.manager import KVCacheManager
from pagoda.request import Request, Sequence, SeqStatus
from pagoda.scheduler.output import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)

# The longest-prefix-match policy scans the queue each step; past this length it costs more
# than it saves and the scheduler falls back to arrival order.
LPM_MAX_QUEUE = 128


@dataclass
class SeqUpdate:
    """What one step did to one sequence, for the engine to report."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list | None = None
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0
        # Requests ended by a failure of their own since the last ``take_failed``: id -> reason.
        self._failed: dict[str, str] = {}
        # Requests that left ``requests`` since the last ``schedule`` (for the executor).
        self._finished_ids: list[str] = []

    # ---- intake --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request. ``n > 1`` starts as one sequence that forks after its prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        seq = Sequence(f"{request.request_id}#0", request, list(request.prompt_token_ids),
                       num_samples=request.params.n)
        self.requests[request.request_id] = [seq]
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of a request now and free its blocks. Unknown ids are ignored."""
        seqs = self.requests.pop(request_id, [])
        if seqs:
            self._finished_ids.append(request_id)
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
        seqs = {id(s): s for s in self.requests.pop(request.request_id, []) if s.request is request}
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
        budget = [self.config.max_num_batched_tokens]
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[Sequence] = []
        # Decodes first, then running prefills; within each group, admission order.
        for seq in sorted(self.running, key=lambda s: s.is_prefilling):
            if seq.status != SeqStatus.RUNNING or budget[0] <= 0:
                continue
            self._schedule_running(seq, drafts.get(seq.seq_id), budget, scheduled, preempted)
        if not preempted:
            self._admit_waiting(budget, scheduled)
        ordered = [scheduled[s.seq_id] for s in self.running if s.seq_id in scheduled]
        ordered.sort(key=lambda s: s.num_new_tokens - s.num_draft_tokens > 1)
        if num_steps > 1 and ordered and not self.waiting and not preempted:
            self._look_ahead(ordered, num_steps)
        now = time.time()
        for item in ordered:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = now
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(ordered, self.config.max_num_batched_tokens - budget[0],
                               self.kv.take_copies(), preempted, finished)

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """How many of ``remaining`` tokens to run now; 0 if the sequence must wait."""
        if remaining <= 1:
            return min(remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        if not self.config.enable_chunked_prefill and seq.num_output_tokens == 0:
            return remaining if remaining <= budget else 0  # whole prompts only
        n = min(remaining, budget)
        return min(n, threshold) if threshold > 0 else n

    def _schedule_running(self, seq: Sequence, draft: Draft | None, budget: list[int],
                          scheduled: dict[str, ScheduledSeq], preempted: list[Sequence]) -> None:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if draft is not None and draft.k and remaining == 1 and budget[0] >= 1 + draft.k:
            n = 1 + draft.k
        else:
            draft = None
            n = self._chunk(seq, remaining, budget[0])
        if n == 0:
            return
        while not self.kv.allocate(seq, n):
            victim = self._pick_victim(scheduled, budget)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return
        scheduled[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, n, draft)
        budget[0] -= n

    def _look_ahead(self, items: list[ScheduledSeq], num_steps: int) -> None:
        """Multi-step decoding: give every item ``steps - 1`` lookahead decode steps, the same for
        all, where each is a one-token decode that samples without anything that reads the tokens
        of the steps in between (logprobs, penalties, a pending min_tokens, a grammar, LoRA, drafts,
        a fork into samples) and without a logit bias (the CPU round takes the raw argmax).
        ``steps`` stops at the nearest max_tokens / max_model_len, so no
        sequence runs past its end. Blocks for the extra tokens come from free memory only: where
        any is short the step stays single (a lookahead never preempts anyone)."""
        steps = num_steps
        for item in items:
            seq, params = item.seq, item.seq.params
            if (item.num_new_tokens != 1 or item.draft is not None or seq.num_samples != 1
                    or seq.num_output_tokens < max(params.min_tokens, 1) or params.logprobs is not None
                    or params.needs_penalties or params.logit_bias or seq.request.grammar is not None
                    or seq.request.lora_request is not None):
                return
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

    def _pick_victim(self, scheduled: dict[str, ScheduledSeq], budget: list[int]) -> Sequence:
        victim = self.running[-1]
        item = scheduled.pop(victim.seq_id, None)
        if item is not None:
            budget[0] += item.num_new_tokens
        return victim

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens, go back to the front of the queue."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(self, budget: list[int], scheduled: dict[str, ScheduledSeq]) -> None:
        if not self.waiting:
            return
        deferred: list[Sequence] = []
        adapters = self._running_adapters()
        while self.waiting and budget[0] > 0:
            seq = self._next_waiting()
            if seq.request.grammar is not None and not seq.request.grammar.ready:
                # Its grammar is still compiling (off the step loop): the others go ahead.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            if len(self.running) + seq.num_samples > self.config.max_num_seqs and self.running:
                break
            lora = seq.request.lora_request
            if lora is not None and lora not in adapters and len(adapters) >= self.config.max_loras:
                # Every adapter slot is taken by running requests: this one waits for a slot,
                # later requests of the running adapters (or the base model) may go ahead.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            prefix = self.kv.match_prefix(seq)
            if self._shares_block_in_flight(seq, prefix.num_tokens):
                # Another sequence is computing this prompt's next block right now: wait a step
                # and reuse it from the cache instead of computing the same KV twice.
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            n = self._chunk(seq, seq.num_tokens - prefix.num_tokens, budget[0])
            if n == 0 or not self.kv.allocate(seq, n, prefix):
                break
            self.waiting.remove(seq)
            if seq.num_output_tokens == 0 and seq.request.metrics.num_preemptions == 0:
                self.kv.record_query(seq.num_tokens, prefix.num_tokens)
                seq.request.num_cached_tokens = prefix.num_tokens
            seq.num_computed_tokens = prefix.num_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if lora is not None:
                adapters.add(lora)
            scheduled[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, n)
            budget[0] -= n
        self.waiting.extendleft(reversed(deferred))

    def _running_adapters(self) -> set:
        """The distinct LoRA adapters of running sequences: a step holds at most ``max_loras``."""
        if not self.config.max_loras:
            return set()
        return {s.request.lora_request for s in self.running if s.request.lora_request is not None}

    def _shares_block_in_flight(self, seq: Sequence, num_cached: int) -> bool:
        """True if a running sequence has the same tokens up to the end of ``seq``'s first
        uncached block and has not finished computing that block yet."""
        if self.kv.cache is None:
            return False
        end = num_cached + self.kv.block_size
        if end > seq.num_tokens - 1:
            return False
        head, lora = seq.token_ids[:end], seq.request.lora_request
        return any(other.num_computed_tokens < end <= other.num_tokens and other.token_ids[:end] == head
                   and other.request.lora_request == lora for other in self.running if other.is_prefilling)

    def _next_waiting(self) -> Sequence:
        if self.config.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            # Preempted sequences keep their place at the front.
            if self.waiting[0].request.metrics.num_preemptions == 0:
                return max(self.waiting, key=lambda s: self.kv.match_prefix(s).num_tokens)
        return self.waiting[0]

    # ---- results -------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, output: ModelOutput) -> list[SeqUpdate]:
        """Apply a step's results: advance progress, append tokens, check stops, free blocks.

        A sequence whose update raises ends its request alone (``fail_request``); the updates
        of a failed request are dropped, everyone else's are returned."""
        updates: list[SeqUpdate] = []
        now = time.time()
        for item in sched.scheduled:
            seq = item.seq
            if seq.status != SeqStatus.RUNNING:
                continue  # aborted while the step ran, or failed
            try:
                updates.extend(self._update_seq(item, output.results.get(seq.seq_id), now))
            except Exception as exc:
                logger.error("request %s failed in the scheduler update; ending it alone", seq.request_id,
                             exc_info=exc)
                self.fail_request(seq.request, f"{type(exc).__name__}: {exc}")
        return [u for u in updates if u.seq.finish_reason != "error"]

    def _update_seq(self, item: ScheduledSeq, result: SeqStepResult | None, now: float) -> list[SeqUpdate]:
        seq = item.seq
        accepted = result.num_draft_accepted if result else 0
        # Lookahead steps computed the K/V of every sampled token but the last.
        ahead = max(len(result.token_ids) - 1, 0) if result and item.num_lookahead else 0
        seq.num_computed_tokens = item.end - item.num_draft_tokens + accepted + ahead
        self.kv.release_outside_window(seq)
        if result is None:
            self.kv.cache_blocks(seq)
            return []
        if result.prompt_logprobs is not None:
            seq.request.prompt_logprobs.extend(result.prompt_logprobs)
        if not result.token_ids:
            self.kv.cache_blocks(seq)
            if result.prompt_logprobs is None:
                return []
            return [SeqUpdate(seq, [], None, result.prompt_logprobs, result.prompt_ranks)]
        targets = self._fork(seq, len(result.token_ids)) if seq.num_samples > 1 else [seq]
        updates = []
        for i, target in enumerate(targets):
            tokens = result.token_ids[i:i + 1] if len(targets) > 1 else result.token_ids
            updates.append(self._append(target, tokens, result, i if len(targets) > 1 else None, now))
        # Prompt logprobs are the request's, reported once with its first sample.
        updates[0].prompt_logprobs, updates[0].prompt_ranks = result.prompt_logprobs, result.prompt_ranks
        return updates

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
        logprobs = [] if result.logprobs is not None else None
        for j, token in enumerate(tokens):
            src = j if index is None else index
            if seq.grammar is not None and not seq.grammar.accept(token):
                raise ValueError(f"the grammar refused token {token}")  # the mask makes this a bug
            seq.token_ids.append(token)
            new_tokens.append(token)
            if logprobs is not None:
                logprobs.append(result.logprobs[src])
            if result.token_logprobs is not None:
                seq.cumulative_logprob += result.token_logprobs[src]
            if self._check_stop(seq, token):
                break
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        self.kv.cache_blocks(seq)
        if seq.finished:
            self._finish(seq)
        else:
            # A rejected speculative tail or a stop may leave blocks past what is needed.
            self.kv.trim(seq, seq.num_tokens)
        return SeqUpdate(seq, new_tokens, logprobs)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        produced = seq.num_output_tokens
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
        if reason is None and seq.num_tokens >= self.config.max_model_len:
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
