"""The contracts between the scheduler and the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import Sequence


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: its tokens ``[start, start + num_new_tokens)``.

    ``num_draft_tokens`` of those new tokens are speculative proposals appended after the
    sequence's last real token; the runner scores them and the sampler accepts a prefix.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    num_draft_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so the step produces its next token."""
        return self.end - self.num_draft_tokens >= self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """Which sequences run this step and how many tokens each (decodes first, then prefill
    chunks), plus block copies (copy on write) to do before the forward pass."""

    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens - s.num_draft_tokens > 1)
