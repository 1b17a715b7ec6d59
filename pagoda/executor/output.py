"""The executor's torch-free contracts with the layers above it: what a step may ask it to
verify (``Draft``) and what a step returns (``ModelOutput``). The scheduler imports these; the
tensors a step runs on are in ``executor.input``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.outputs import Logprobs

if TYPE_CHECKING:
    import torch


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
