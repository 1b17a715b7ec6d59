"""The contracts of one engine step, torch-free, between the scheduler, the executor and the
speculative proposers, which all import them and none of which owns them:

- ``Draft``: speculative tokens a proposer offers for one sequence; the runner verifies them.
- ``ScheduledSeq`` / ``SchedulerOutput``: what runs this step (the scheduler's answer).
- ``SeqStepResult`` / ``ModelOutput``: what the step produced (the executor's answer).

The tensors a step runs on are built from these in ``executor.input``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagoda.outputs import Logprobs
from pagoda.request import Sequence

if TYPE_CHECKING:
    import torch

    from pagoda.kvcache.tiers.base import KVTransfers


class StepAbandoned(Exception):
    """Raised between decoder layers when a step made only of background (batch) rows is given
    up because interactive work arrived (``AttentionMetadata.abandon``). What the step wrote to
    the KV cache is at positions it had not computed yet, rewritten when those rows run again."""


@dataclass
class Draft:
    """Speculative tokens proposed for one sequence's next step.

    ``token_ids``: the ``k`` proposed tokens, to follow the sequence's last token. ``probs``:
    ``[k, vocab]``, the draft model's processed distribution each token was sampled from, or
    None for a point mass on each token (n-gram proposals and greedy drafts). The scheduler
    carries a draft in ``ScheduledSeq.draft``; the model runner scores and verifies it.
    """

    token_ids: list[int]
    probs: "torch.Tensor | None" = None

    @property
    def k(self) -> int:
        return len(self.token_ids)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: its tokens ``[start, start + num_new_tokens)``.

    With a ``draft``, the last ``draft.k`` of those new tokens are its speculative proposals,
    placed after the sequence's last real token; the runner scores them and accepts a prefix.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    draft: Draft | None = None
    # Grammar-constrained sequences that sample this step: the allowed tokens at each scored
    # position (1, or 1 + k with a draft), ``bitmask.rows()`` an int32 ``[positions,
    # ceil(vocab / 32)]`` (structured_output.manager.BitmaskRows, filled while the forward pass
    # runs); None when unconstrained.
    bitmask: Any = None
    # Multi-step decoding: after this step's token the runner runs the sequence this many more
    # decode steps in a row, each fed the token the previous one sampled (its blocks hold them
    # all); the result then has up to 1 + num_lookahead tokens.
    num_lookahead: int = 0

    @property
    def num_draft_tokens(self) -> int:
        # Asked about every sequence about seven times a step: not through ``Draft.k``, a call more.
        return len(self.draft.token_ids) if self.draft is not None else 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so the step produces its next token."""
        # (Asked of every sequence a few times a step: spelled out rather than through the
        # ``end``, ``num_draft_tokens`` and ``Sequence.num_tokens`` properties.)
        drafts = len(self.draft.token_ids) if self.draft is not None else 0
        return self.start + self.num_new_tokens - drafts >= len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    """Which sequences run this step and how many tokens each (decodes first, then prefill
    chunks), plus block copies (copy on write) to do before the forward pass.

    ``finished_request_ids``: requests that left the engine (finished, aborted, failed) since
    the previous step; the executor drops its per-request state (seeded generators) for them
    before running this step, so a later request may reuse the id.

    ``state_copies``: recurrent-state slot copies (hybrid models' forks), done with the block
    copies.

    ``kv_transfers``: KV-tier copies (snapshots of blocks going out, then blocks coming in)
    to do before the block copies and the forward pass; None when there are none.
    """

    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    kv_transfers: KVTransfers | None = None
    # Hybrid models: recurrent-state copies (src slot, dst slot) to do before the forward pass
    # (a prompt forked into its n samples).
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens - s.num_draft_tokens > 1)


@dataclass
class SeqStepResult:
    """New tokens for one sequence (one token normally; several after speculation or when a
    prompt with ``n > 1`` forks: then one per sample)."""

    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    token_logprobs: list[float] | None = None  # logprob of each sampled token (cumulative_logprob)
    prompt_logprobs: list[Logprobs | None] | None = None
    num_draft_accepted: int = 0
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank, beside prompt_logprobs
    # An embedding request's pooled vector (its prompt's last chunk; ``token_ids`` is then empty).
    embedding: list[float] | None = None


@dataclass
class ModelOutput:
    """Per scheduled sequence id, the step's result (absent for mid-prompt chunks).

    ``failed``: sequences whose own post-forward work (prompt logprobs, sampling, draft
    verification) raised, with the reason; they have no result and their request must end.
    Everyone else's results are complete."""

    results: dict[str, SeqStepResult] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # A background-only step given up mid-forward (``StepAbandoned``): no results at all, and
    # the scheduler's update must not run (every sequence stays where the step found it).
    abandoned: bool = False
    # Async scheduling: the step's ids still on the device (``executor.sampler.DeviceTokens``);
    # ``resolve`` adds them to ``results`` (waiting for their copy to the host), and the next
    # step's placeholder rows are filled from them on the device.
    pending: Any = None

    def resolve(self) -> "ModelOutput":
        """This output with every result on the host (waits for pending device ids)."""
        if self.pending is not None and not self.pending.resolved:
            self.results.update(self.pending.results())
        return self
