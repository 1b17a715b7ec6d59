"""Speculative-decoding proposers: the engine core's hook for drafting tokens.

Each step the engine core calls ``propose(scheduler)`` before scheduling: the proposer sets
``draft_token_ids`` (and ``draft_probs`` for a sampled draft) on running decode sequences. The
scheduler verifies them as ``1 + k`` tokens in the ordinary batch, the model runner accepts a
prefix (``spec_decode.rejection``), and ``observe`` counts what happened.
"""
from __future__ import annotations

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.executor.output import ModelOutput
from pagoda.request import Sequence
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.scheduler import Scheduler


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
    def propose(self, scheduler: Scheduler) -> None:
        self.release_finished()  # also sequences preempted since
        for seq in scheduler.running:
            # A sequence the last step did not reach may still hold drafts: propose afresh.
            seq.draft_token_ids, seq.draft_probs = [], None
        wanted = self.candidates(scheduler)
        if wanted:
            self.draft(wanted)

    def observe(self, sched: SchedulerOutput, output: ModelOutput) -> None:
        self._count(sched, output)
        self.release_finished()  # finished sequences give their state back at once

    def _count(self, sched: SchedulerOutput, output: ModelOutput) -> None:
        for item in sched.scheduled:
            k = item.num_draft_tokens
            if not k:
                continue
            result = output.results.get(item.seq.seq_id)
            accepted = result.num_draft_accepted if result is not None else 0
            self.num_proposed += k
            self.num_accepted += accepted
            self.num_verify_steps += 1
            metrics = item.seq.request.metrics
            metrics.spec_proposed_tokens += k
            metrics.spec_accepted_tokens += accepted

    # ---- for subclasses ------------------------------------------------------------------
    def draft(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set up to ``k`` drafts on each ``(seq, k)``."""
        raise NotImplementedError

    def release_finished(self) -> None:
        """Drop per-sequence state of sequences that no longer need it."""

    def reset(self) -> None:
        """Drop all per-sequence state (after a failure left it unknown); it is rebuilt from
        the sequences' tokens as they speculate again. The counters stay."""

    # ---- selection -----------------------------------------------------------------------
    def candidates(self, scheduler: Scheduler) -> list[tuple[Sequence, int]]:
        """Running decodes and how many drafts each may use; none when the batch is large,
        because verification costs compute that a full batch has no spare of. Waiting
        sequences count towards the batch (up to the sequence cap): they join it within steps,
        and drafting for a batch about to grow (a burst being admitted) is mostly wasted."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and min(scheduler.num_unfinished, self.max_num_seqs) > limit:
            return []
        out = []
        for seq in scheduler.running:
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


def make_proposer(config: EngineConfig, executor: object) -> Proposer:
    """The proposer named by ``config.speculative.method``."""
    assert config.speculative is not None
    method = config.speculative.method
    if method == "ngram":
        from pagoda.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    if method == "draft_model":
        from pagoda.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, executor)
    raise ValueError(f"unknown speculative method {method!r}")
