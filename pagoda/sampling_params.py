"""User-facing sampling options, validated once at construction (vLLM's shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", f"logprobs must be non-negative, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
        ]
        for ok, _name, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def clone(self, **changes: object) -> "SamplingParams":
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
