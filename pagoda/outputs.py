"""Results handed back to users: vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field

# One generated position's logprobs: token id -> logprob (the sampled token first, then the top-k).
Logprobs = dict[int, float]


@dataclass
class RequestMetrics:
    """Engine-side timestamps (``time.time()`` seconds) and speculative-decoding counters."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        if not self.spec_proposed_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_proposed_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per decode step since speculation began: each step emits its accepted
        drafts plus one token of the target's own, so steps = emitted - accepted."""
        steps = self.spec_emitted_tokens - self.spec_accepted_tokens
        if not self.spec_proposed_tokens or steps <= 0:
            return None
        return self.spec_emitted_tokens / steps


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the engine failed it)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # Beside prompt_logprobs: each position's prompt-token rank (1: the likeliest; None first).
    prompt_logprob_ranks: list[int | None] | None = None
    # Embedding requests (``SamplingParams.pooling``): the pooled final hidden state, float32.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (float32 values as Python floats)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's shape: ``out.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
