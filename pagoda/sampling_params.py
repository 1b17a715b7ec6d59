"""User-facing sampling options, validated once at construction (vLLM's shape).

The limits below are the single source of the numbers: ``SamplingParams`` enforces them for
the offline ``LLM`` and the server alike, and the server's pydantic models
(``entrypoints/openai/protocol.py``) derive their field constraints (and so the OpenAPI
document) from the same constants. Rules that need the model (vocabulary size, context length,
``--max-logprobs``) live in ``engine/input_processor.py`` (``InputProcessor.validate``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from pagoda.errors import ParamError as ParamError  # re-exported: callers import it from here
from pagoda.errors import check
from pagoda.pooling import POOLING_TYPES
from pagoda.structured_output.params import StructuredOutputsParams

# torch.Generator.manual_seed takes any integer of int64 or uint64 range; sample i of a seeded
# request uses seed + i, so seed + n - 1 must stay inside too.
SEED_MIN = -(2 ** 63)
SEED_MAX = 2 ** 64 - 1
# Samples per prompt. Each one is a sequence holding KV blocks; a bound keeps one request from
# monopolising the engine (OpenAI caps n at 128 too).
MAX_N = 128
# bad_words entries (vLLM sets no bound; each is matched at every step of its request).
MAX_BAD_WORDS = 128
# allowed_token_ids entries: a vocabulary's worth (the largest vocabularies are ~260k ids).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# Softmax of logits / 100 is already uniform for any real model; more only hides typos.
MAX_TEMPERATURE = 100.0
# Penalties as OpenAI defines them.
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0
# Repetition penalty divides (or multiplies) logits: below 0.01 or above 100 the results overflow
# float16 logits or are indistinguishable from the bounds.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Stop conditions: every stop string is checked on each new piece of text, so both the count and
# the length are bounded; stop token ids become a per-step mask.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# vLLM's default for ``--max-logprobs`` (the per-position top-k the engine computes).
DEFAULT_MAX_LOGPROBS = 20
# logit_bias as OpenAI defines it: each bias in [-100, 100] (-100 bans a token, 100 all but forces
# it). The map becomes per-step index tensors, so its size is bounded like stop_token_ids.
MIN_LOGIT_BIAS, MAX_LOGIT_BIAS = -100.0, 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def _is_int(value: object) -> bool:
    # A bool is an int to Python but never a count or an id to a user.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; a ``ParamError`` naming ``name`` otherwise."""
    check(_is_int(value), name, f"{name} must be an integer, got {value!r}")
    value = int(value)  # type: ignore[arg-type]
    check((low is None or value >= low) and (high is None or value <= high), name,
          f"{name} must be {_range_text(low, high)}, got {value}")
    return value


def check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] ((low, high] with ``low_open``)."""
    check(_is_real(value), name, f"{name} must be a number, got {value!r}")
    value = float(value)  # type: ignore[arg-type]
    check(math.isfinite(value), name, f"{name} must be a finite number, got {value}")
    above = value > low if low_open else value >= low
    check(above and value <= high, name, f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], "
          f"got {value:g}")
    return value


def _bias_token(key: object) -> int:
    """A logit_bias key as a token id: an int, or its decimal text (JSON maps have string keys)."""
    if isinstance(key, str) and key.isascii() and key.isdecimal():
        key = int(key)
    check(_is_int(key) and int(key) >= 0, "logit_bias",  # type: ignore[call-overload]
          f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
    return int(key)  # type: ignore[call-overload]


def _range_text(low: int | None, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    if low is None:
        return f"at most {high}"
    return f"in [{low}, {high}]"


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``ParamError`` (a
    ``ValueError``) naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # -1: no seed, as None (vLLM's convention)
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
    # Constrained decoding: JSON schema, regex, choice or grammar (pagoda.structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> bias added to its logit before sampling (every row: greedy, speculative, grammar).
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (every other logit -inf, before the bias).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. The engine spells each as token ids (at the text's start and
    # after a space: ``InputProcessor.validate`` fills ``bad_words_token_ids``); a word's last
    # token is banned wherever the output so far ends with the tokens before it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len; a text prompt's
    # own tokens, images not allowed with it). InputProcessor.truncate applies it.
    truncate_prompt_tokens: int | None = None
    # Embedding: pool the prompt's final hidden states (LAST, MEAN or CLS) instead of sampling;
    # the request ends after its prefill with the pooled vector (``RequestOutput.embedding``).
    pooling: str | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop",
              "stop must be a string or a list of strings")
        check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
              "stop_token_ids must be a list of integers")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Check every field (again: the object is mutable, so the engine re-checks what it is
        given); raises ``ParamError`` naming the first bad field."""
        self._validate_numbers()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            value = getattr(self, name)
            check(isinstance(value, bool), name, f"{name} must be true or false, got {value!r}")
        self._validate_lists()
        check(self.detokenize or not self.stop, "stop",
              "stop strings need detokenize=True (they are matched in the text)")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if self.top_k == 0:
            self.top_k = -1
        check(self.pooling is None or self.pooling in POOLING_TYPES, "pooling",
              f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")

    def _validate_numbers(self) -> None:
        self.n = check_int("n", self.n, 1, MAX_N)
        self.temperature = check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        # The sampler always keeps the most likely token, so any positive top_p is meaningful.
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        # The upper bound (the vocabulary size) needs the model: InputProcessor.validate.
        self.top_k = check_int("top_k", self.top_k, -1)
        self.min_p = check_float("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, check_float(name, getattr(self, name), MIN_PENALTY, MAX_PENALTY))
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty,
                                              MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None  # vLLM's spelling of "no seed"
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, SEED_MIN, SEED_MAX)
            check(self.seed + self.n - 1 <= SEED_MAX, "seed", f"seed + n - 1 must be at most {SEED_MAX} "
                  f"(sample i is seeded with seed + i), got seed {self.seed} with n {self.n}")
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            check(self.truncate_prompt_tokens != 0, "truncate_prompt_tokens",
                  "truncate_prompt_tokens must be -1 (the context length) or at least 1, got 0")
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0)
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        # Upper bounds (--max-logprobs) are the engine's: InputProcessor.validate.
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(name, getattr(self, name), 0))

    def _validate_lists(self) -> None:
        check(isinstance(self.stop, list) and isinstance(self.stop_token_ids, list), "stop",
              "stop and stop_token_ids must be lists")
        stop, ids = self.stop, self.stop_token_ids
        check(len(stop) <= MAX_STOP_STRINGS, "stop", f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}")
        for s in stop:
            check(isinstance(s, str) and bool(s), "stop", "stop strings must be non-empty strings")
            check(len(s) <= MAX_STOP_STRING_CHARS, "stop",
                  f"a stop string has {len(s)} characters; at most {MAX_STOP_STRING_CHARS}")
        check(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
              f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        # Each id's upper bound (the vocabulary) is checked in InputProcessor.validate.
        self.stop_token_ids = [check_int("stop_token_ids", t, 0) for t in ids]
        allowed = self.allowed_token_ids
        if allowed is not None:
            check(isinstance(allowed, (list, tuple)) and 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS,
                  "allowed_token_ids", f"allowed_token_ids must be a non-empty list of at most "
                  f"{MAX_ALLOWED_TOKEN_IDS} token ids")
            self.allowed_token_ids = [check_int("allowed_token_ids", t, 0) for t in allowed]
        if self.bad_words is not None:
            words = self.bad_words
            check(isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS
                  and all(isinstance(w, str) and 0 < len(w.strip()) <= MAX_STOP_STRING_CHARS for w in words),
                  "bad_words", f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                  f"{MAX_STOP_STRING_CHARS} characters")
            self.bad_words = list(words)
        if self.bad_words_token_ids is not None:
            spelled = self.bad_words_token_ids
            check(isinstance(spelled, (list, tuple)) and len(spelled) <= 2 * MAX_BAD_WORDS
                  and all(isinstance(w, (list, tuple)) and 0 < len(w) <= MAX_STOP_STRING_CHARS for w in spelled),
                  "bad_words", "bad_words_token_ids must be a list of non-empty token id lists")
            self.bad_words_token_ids = [[check_int("bad_words", t, 0) for t in w] for w in spelled]
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        """Ids non-negative integers (the vocabulary bound is InputProcessor.validate's), biases
        finite in [-100, 100], at most ``MAX_LOGIT_BIAS_ENTRIES`` of them; an empty map is None."""
        bias = self.logit_bias
        if bias is None:
            return
        check(isinstance(bias, dict), "logit_bias", "logit_bias must be a map of token id to bias")
        check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
              f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
        self.logit_bias = {_bias_token(t): check_float("logit_bias", b, MIN_LOGIT_BIAS, MAX_LOGIT_BIAS)
                           for t, b in bias.items()} or None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def edits_logits(self) -> bool:
        """Whether step 0 of the sampling pipeline changes this request's logits (a logit bias,
        allowed token ids, bad words): no path that takes the raw argmax may serve it."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def clone(self, **changes: object) -> "SamplingParams":
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
