"""What a model step returns to the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.outputs import Logprobs


@dataclass
class SeqStepResult:
    """New tokens for one sequence (one token normally; several after speculation or when a
    prompt with ``n > 1`` forks: then one per sample)."""

    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    token_logprobs: list[float] | None = None  # logprob of each sampled token (cumulative_logprob)
    prompt_logprobs: list[Logprobs | None] | None = None
    num_draft_accepted: int = 0


@dataclass
class ModelOutput:
    """Per scheduled sequence id, the step's result (absent for mid-prompt chunks).

    ``failed``: sequences whose own post-forward work (prompt logprobs, sampling, draft
    verification) raised, with the reason; they have no result and their request must end.
    Everyone else's results are complete."""

    results: dict[str, SeqStepResult] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
