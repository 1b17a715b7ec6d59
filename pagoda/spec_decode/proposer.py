"""Speculative-decoding proposers: the engine core's hook for drafting tokens.

Each step the engine core calls ``propose(running, num_unfinished)`` before scheduling and
gets a ``Draft`` (``pagoda.step``) per running decode sequence that speculates, keyed by
sequence id. It hands them to ``Scheduler.schedule``, which runs each as ``1 + k`` tokens in the
ordinary batch (``ScheduledSeq.draft``); the model runner accepts a prefix
(``executor.rejection``), and ``observe`` counts what happened. Proposers never touch the
sequences: drafts live only in the step that verifies them.
"""
from __future__ import annotations

from typing import Iterable

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.request import Sequence
from pagoda.step import Draft, ModelOutput


class Proposer:
    """Chooses which sequences speculate and by how much, and keeps the counters; subclasses
    implement ``draft``."""

    def __init__(self, config: EngineConfig) -> None:
        assert config.speculative is not None
        self.spec: SpeculativeConfig = config.speculative
        self.max_model_len = config.model.max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.num_proposed = 0  # draft tokens sent for verification
        self.num_accepted = 0
        self.num_verify_steps = 0  # sequence-steps that verified at least one draft

    # ---- the engine hooks ----------------------------------------------------------------
    def propose(self, running: list[Sequence], num_unfinished: int) -> dict[str, Draft]:
        """Drafts for this step, by sequence id, for some of the ``running`` sequences;
        ``num_unfinished`` (running + waiting) decides whether the batch is too large."""
        self.release_finished()  # also sequences preempted since
        wanted = self.candidates(running, num_unfinished)
        if not wanted:
            return {}
        return {seq_id: d for seq_id, d in self.draft(wanted).items() if d.token_ids}

    def observe(self, verified: Iterable[tuple[Sequence, int]], output: ModelOutput) -> None:
        """After a step: ``verified`` are the sequences that ran drafts, with how many."""
        self._count(verified, output)
        self.release_finished()  # finished sequences give their state back at once

    def _count(self, verified: Iterable[tuple[Sequence, int]], output: ModelOutput) -> None:
        for seq, k in verified:
            if not k:
                continue
            result = output.results.get(seq.seq_id)
            accepted = result.num_draft_accepted if result is not None else 0
            self.num_proposed += k
            self.num_accepted += accepted
            self.num_verify_steps += 1
            metrics = seq.request.metrics
            metrics.spec_proposed_tokens += k
            metrics.spec_accepted_tokens += accepted

    # ---- for subclasses ------------------------------------------------------------------
    def draft(self, wanted: list[tuple[Sequence, int]]) -> dict[str, Draft]:
        """Up to ``k`` drafts for each ``(seq, k)``, by sequence id."""
        raise NotImplementedError

    def release_finished(self) -> None:
        """Drop per-sequence state of sequences that no longer need it."""

    def reset(self) -> None:
        """Drop all per-sequence state (after a failure left it unknown); it is rebuilt from
        the sequences' tokens as they speculate again. The counters stay."""

    # ---- selection -----------------------------------------------------------------------
    def candidates(self, running: list[Sequence], num_unfinished: int) -> list[tuple[Sequence, int]]:
        """Running decodes and how many drafts each may use; none when the batch is large,
        because verification costs compute that a full batch has no spare of. Waiting
        sequences count towards the batch (up to the sequence cap): they join it within steps,
        and drafting for a batch about to grow (a burst being admitted) is mostly wasted."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and min(num_unfinished, self.max_num_seqs) > limit:
            return []
        out = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_samples > 1:
                continue  # still prefilling, or about to fork into its samples
            k = self.max_drafts(seq)
            if k > 0:
                out.append((seq, k))
        return out

    def max_drafts(self, seq: Sequence) -> int:
        """A step emits at most ``k + 1`` tokens: drafting past the length limits is wasted."""
        k = min(self.spec.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    # ---- reporting -----------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verifying sequence-step (accepted drafts + the target's token)."""
        if not self.num_verify_steps:
            return None
        return (self.num_accepted + self.num_verify_steps) / self.num_verify_steps

