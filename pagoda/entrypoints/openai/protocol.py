"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests accept OpenAI's fields plus a few engine extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...). Nothing is
silently ignored: an unknown field is a 400 naming it (``extra="forbid"``), and OpenAI fields
pagoda does not implement are accepted only with their no-op value (``NOOP_FIELDS``). Types are
strict (a boolean is not a number, ``"5"`` is not an integer) and the numeric bounds come from
``pagoda.sampling_params``, so the OpenAPI document shows the same limits the engine enforces.
Bounds that depend on the model (vocabulary, context length, ``--max-logprobs``) are checked
later by ``InputProcessor.validate``.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationInfo, field_validator,
                      model_serializer)

from pagoda.engine.input_processor import MAX_MESSAGES
from pagoda.sampling_params import (MAX_N, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS,
                                    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MIN_PENALTY,
                                    MIN_REPETITION_PENALTY, SEED_MAX, SEED_MIN, SamplingParams)

# Prompts in one /v1/completions request (each is its own engine request).
MAX_PROMPTS_PER_REQUEST = 128
# Samples in one request (prompts x n): the work one HTTP call may queue.
MAX_SAMPLES_PER_REQUEST = 1024

# OpenAI fields pagoda does not implement, accepted only with the value that changes nothing.
NOOP_FIELDS: dict[str, str] = {
    "best_of": "null or equal to n",
    "logit_bias": "null or {}",
    "suffix": "null or an empty string",
    "response_format": '{"type": "text"} or null',
    "tools": "[] or null",
    "tool_choice": '"none" or null',
    "functions": "[] or null",
    "function_call": '"none" or null',
    "store": "false or null",
    "tool_calls": "[] or null",
    "refusal": "null",
}


class OpenAIModel(BaseModel):
    """A response body (built by the server, so no validation rules)."""

    model_config = ConfigDict(extra="ignore")


class RequestModel(BaseModel):
    """A request body: strict types, and any field not declared here is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


# A float in a request: finite (NaN, Infinity and 1e309 are refused), ints welcome.
def _float(low: float, high: float, *, low_open: bool = False, default: float | None = None) -> Any:
    bound = {"gt": low} if low_open else {"ge": low}
    return Field(default, le=high, allow_inf_nan=False, **bound)


TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
NoList = Annotated[list[Any], Field(max_length=0)]


# ---- requests ----------------------------------------------------------------------------

class StreamOptions(RequestModel):
    include_usage: bool | None = False


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = _float(0.0, MAX_TEMPERATURE)
    top_p: float | None = _float(0.0, 1.0, low_open=True)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off; at most the vocabulary size")
    min_p: float | None = _float(0.0, 1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="seed + n - 1 must not exceed the maximum")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float | None = _float(MIN_PENALTY, MAX_PENALTY)
    frequency_penalty: float | None = _float(MIN_PENALTY, MAX_PENALTY)
    repetition_penalty: float | None = _float(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Build (and so validate) the engine's parameters; raises ``ParamError`` naming a field."""
        defaults = SamplingParams.__dataclass_fields__
        chosen = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")}
        chosen = {name: value if value is not None else defaults[name].default for name, value in chosen.items()}
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, **chosen)


PromptList = Annotated[list[str], Field(max_length=MAX_PROMPTS_PER_REQUEST)]
TokenPromptList = Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS_PER_REQUEST)]


class CompletionRequest(SamplingRequest):
    # The bound on a text prompt's length and a token prompt's count depends on max_model_len.
    prompt: str | PromptList | list[TokenId] | TokenPromptList
    max_tokens: int | None = Field(16, ge=1, description="prompt tokens + max_tokens must fit max_model_len")
    logprobs: int | None = Field(None, ge=0, description="at most the server's --max-logprobs (default 20)")
    echo: bool = False
    suffix: Annotated[str, Field(max_length=0)] | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only null or equal to n")

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        # best_of > n would generate samples and return only the best: not implemented.
        if value is not None and value != info.data.get("n", 1):
            raise ValueError(f"best_of ({value}) must equal n ({info.data.get('n', 1)})")
        return value


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


# Tagged by "type", so an unsupported part (image_url, input_audio, ...) is refused by its type.
ContentPart = Annotated[Union[TextPart], Field(discriminator="type")]


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # What an assistant message from an OpenAI client may carry back; only the no-op values.
    tool_calls: NoList | None = None
    refusal: None = None

    def template_input(self) -> dict[str, Any]:
        """The message as ``InputProcessor.check_messages`` takes it (and offline users give it)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            message["content"] = [part.model_dump() for part in self.content]
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(RequestModel):
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_tokens: int | None = Field(None, ge=1, description="prompt tokens + max_tokens must fit max_model_len")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="at most the server's --max-logprobs (default 20)")
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: NoList | None = None
    tool_choice: Literal["none"] | None = None
    functions: NoList | None = None
    function_call: Literal["none"] | None = None
    # Without tools, parallel tool calls cannot happen either way.
    parallel_tool_calls: bool | None = None
    store: Literal[False] | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    # Default: True for a prompt, False for messages (the chat template holds any BOS).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ---------------------------------------------------------------------------

class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A delta carries only what changed: OpenAI sends {"content": "..."}, no null role.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class HealthResponse(OpenAIModel):
    status: Literal["ok"] = "ok"
    engine_pid: int | None = None


class VersionResponse(OpenAIModel):
    version: str
