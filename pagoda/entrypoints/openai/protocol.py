"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests accept every field of OpenAI's Completions and Chat Completions schemas plus vLLM's
extensions (``top_k``, ``min_p``, ``chat_template_kwargs``, ``guided_json``, ...). Fields with no
effect on a self-hosted server are accepted and do nothing (``IGNORED_FIELDS``); fields whose
value would matter but that pagoda does not implement accept only their no-op value
(``NOOP_FIELDS``). A field no model declares is kept aside (``extra="allow"``) for the server's
field policy (``pop_unknown_fields``): ignored with a warning, or a 400 with
``--strict-request-fields``. Types of declared fields are strict (a boolean is not a number,
``"5"`` is not an integer) and the numeric bounds come from ``pagoda.sampling_params``, so the
OpenAPI document shows the same limits the engine enforces.
Bounds that depend on the model (vocabulary, context length, ``--max-logprobs``) are checked
later by ``InputProcessor.validate``.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, SerializerFunctionWrapHandler, Tag, ValidationInfo,
                      field_validator, model_serializer)

from pagoda.engine.input_processor import MAX_MESSAGES
from pagoda.sampling_params import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_N,
                                    MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                    MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MIN_LOGIT_BIAS, MIN_PENALTY,
                                    MIN_REPETITION_PENALTY, SEED_MAX, SEED_MIN, SamplingParams)

# Prompts in one /v1/completions request (each is its own engine request).
MAX_PROMPTS_PER_REQUEST = 128
# Samples in one request (prompts x n): the work one HTTP call may queue.
MAX_SAMPLES_PER_REQUEST = 1024

# Characters of a cache_salt (a secret shared by the requests that may share cached prefixes).
MAX_CACHE_SALT_CHARS = 1024
# Bounds of a request's priority and timeout (seconds). A shorter timeout could pass before an
# idle engine even schedules the request, a 503 that no retry would cure.
MAX_PRIORITY = 2**31 - 1
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 86400.0

# OpenAI fields pagoda does not implement, accepted only with the value that changes nothing.
NOOP_FIELDS: dict[str, str] = {
    "best_of": "null or equal to n",
    "suffix": "null or an empty string",
    "functions": "[] or null (use tools)",
    "function_call": '"none" or null (use tool_choice)',
    "refusal": "null",
    # OpenAI's audio output: pagoda generates text only.
    "audio": "null (pagoda generates text only)",
    "modalities": '["text"] or null (pagoda generates text only)',
    # vLLM extensions pagoda does not implement.
    "use_beam_search": "false",
    "length_penalty": "1.0 (it applies to beam search only)",
    "chat_template": "null (a request may not bring its own chat template)",
    "logits_processors": "null",
    "prompt_embeds": "null",
    "structural_tag": "null",
    "guided_whitespace_pattern": "null",
    "return_tokens_as_token_ids": "false",
    "return_token_ids": "false",
    "kv_transfer_params": "null",
    "spaces_between_special_tokens": "true",
    "max_repetition_pattern_size": "0",
    "min_repetition_pattern_size": "0",
    "repetition_min_count": "0",
}

# Fields accepted with any value of their type that change nothing on a self-hosted server
# (OpenAI's account, storage, routing and hosted-tool fields; vLLM's hints for other engines).
IGNORED_FIELDS = ("metadata", "store", "service_tier", "user", "prediction", "safety_identifier",
                  "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "verbosity",
                  "web_search_options", "moderation", "stream_options.include_obfuscation", "request_id",
                  "guided_decoding_backend", "mm_processor_kwargs", "vllm_xargs")

# How many unknown fields one warning names (a hostile body can carry thousands).
MAX_UNKNOWN_NAMED = 10


class OpenAIModel(BaseModel):
    """A response body (built by the server, so no validation rules)."""

    model_config = ConfigDict(extra="ignore")


class RequestModel(BaseModel):
    """A request body: strict types; a field not declared is kept in ``model_extra`` for the
    server's field policy to drop (with a warning) or refuse (``pop_unknown_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True)


def pop_unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The paths (``frobnicate``, ``messages[0].audio``) of the fields a request carried that no
    model declares, at any depth; they are removed from the models, so nothing downstream (a
    ``model_dump`` for the chat template) sees them."""
    found = [prefix + name for name in model.model_extra or {}]
    if model.model_extra:
        model.model_extra.clear()
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found += pop_unknown_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found += pop_unknown_fields(item, f"{prefix}{name}[{i}].")
    return found


# A float in a request: finite (NaN, Infinity and 1e309 are refused), ints welcome.
def _float(low: float, high: float, *, low_open: bool = False, default: float | None = None) -> Any:
    bound = {"gt": low} if low_open else {"ge": low}
    return Field(default, le=high, allow_inf_nan=False, **bound)


TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
NoList = Annotated[list[Any], Field(max_length=0)]
# logit_bias as JSON carries it: token ids as decimal strings (the vocabulary bound is the engine's).
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                           Annotated[float, Field(ge=MIN_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]],
                      Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


# ---- requests ----------------------------------------------------------------------------

class StreamOptions(RequestModel):
    include_usage: bool | None = False
    # With include_usage: every chunk carries the usage so far (vLLM's extension).
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # no effect: nothing is obfuscated


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
    logit_bias: LogitBias | None = Field(None, description="token id -> bias added to its logit; ids inside the "
                                         "vocabulary")
    # vLLM's extension: per prompt position the prompt token's logprob and the top k (not streamed).
    prompt_logprobs: int | None = Field(None, ge=0, description="at most the server's --max-logprobs (default 20)")
    user: str | None = None
    # vLLM's prefix-cache salt: a request reuses cached prompt prefixes only of requests with the same salt.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's priority (with --scheduling-policy priority; else only 0): lower runs first.
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # pagoda's deadline: seconds from arrival. Still waiting then: a 503 with Retry-After; running:
    # it ends with finish_reason "timeout".
    timeout: float | None = Field(None, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Structured output (pagoda.structured_output): OpenAI's response_format, vLLM's extension
    # and vLLM's older names of its parts (each an alias of one structured_outputs kind).
    response_format: "ResponseFormat | None" = None
    structured_outputs: "StructuredOutputsRequest | None" = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # no effect: pagoda has its own backend choice
    guided_whitespace_pattern: None = None
    # vLLM's extensions with meaning that pagoda does not implement: their no-op value only.
    use_beam_search: Literal[False] = False
    length_penalty: float = Field(1.0, ge=1.0, le=1.0)
    logits_processors: None = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    # vLLM's: words never generated.
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    structural_tag: None = None
    return_tokens_as_token_ids: Literal[False] = False
    return_token_ids: Literal[False] = False
    kv_transfer_params: None = None
    spaces_between_special_tokens: Literal[True] = True
    max_repetition_pattern_size: int = Field(0, ge=0, le=0)
    min_repetition_pattern_size: int = Field(0, ge=0, le=0)
    repetition_min_count: int = Field(0, ge=0, le=0)
    # No effect here (see IGNORED_FIELDS).
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    service_tier: str | None = None
    request_id: str | None = None
    vllm_xargs: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As vLLM and OpenAI: options of a stream on a request that does not stream (an empty
        # object passes, as there).
        if value is not None and value.model_fields_set and not info.data.get("stream", False):
            raise ValueError("stream_options can only be given with stream: true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk: ``continuous_usage_stats`` with ``include_usage``."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)  # type: ignore[union-attr]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        model_defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Build (and so validate) the engine's parameters; raises ``ParamError`` naming a field.
        A sampling field the request leaves unset takes ``model_defaults``' value (the model's
        generation config, ``ModelConfig.generation_defaults``), else the engine's default."""
        defaults = SamplingParams.__dataclass_fields__
        model_defaults = model_defaults or {}
        chosen = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")}
        chosen = {name: value if value is not None else model_defaults.get(name, defaults[name].default)
                  for name, value in chosen.items()}
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words or None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, **chosen)


PromptList = Annotated[list[str], Field(max_length=MAX_PROMPTS_PER_REQUEST)]
TokenPromptList = Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS_PER_REQUEST)]


class CompletionRequest(SamplingRequest):
    # The bound on a text prompt's length and a token prompt's count depends on max_model_len.
    prompt: str | PromptList | list[TokenId] | TokenPromptList
    max_tokens: int | None = Field(16, ge=0, description="prompt tokens + max_tokens must fit max_model_len; "
                                   "0 only with echo (prompt scoring: the prompt and its logprobs, nothing generated)")
    logprobs: int | None = Field(None, ge=0, description="at most the server's --max-logprobs (default 20)")
    echo: bool = False
    suffix: Annotated[str, Field(max_length=0)] | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only null or equal to n")
    add_special_tokens: bool = True  # a text prompt's BOS (vLLM's extension)
    prompt_embeds: None = None

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


class ImageURL(RequestModel):
    url: str = Field(min_length=1, description="a data: URL; an http(s):// URL only for hosts in the server's "
                     "--allowed-media-domains; a file:// URL only under --allowed-local-media-path")
    detail: str | None = None  # accepted and ignored: the model's own processor sizes the image


class ImageURLPart(RequestModel):
    """An image (pagoda.multimodal.chat_parts): ``image_url`` as an object or, in the shorthand
    form, the URL string; ``type`` may be left out in the shorthand form (as vLLM accepts)."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURL | Annotated[str, Field(min_length=1)]


def _part_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "image_url" if "image_url" in value else None)
    return getattr(value, "type", None)


# Tagged by "type", so an unsupported part (input_audio, file, ...) is refused by its type.
ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[ImageURLPart, Tag("image_url")]],
                        Discriminator(_part_kind)]


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's earlier tool calls, and a tool result's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None
    # An earlier reply's thinking, sent back as the server gave it (templates such as Qwen3's
    # read it; most drop it from earlier turns); ``reasoning`` is vLLM's other name for it. The
    # template gets it under both and as ``thinking`` (gpt-oss's), ``InputProcessor.check_messages``.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def template_input(self) -> dict[str, Any]:
        """The message as ``InputProcessor.check_messages`` takes it (and offline users give it)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            message["content"] = [part.model_dump() for part in self.content]
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.reasoning is not None:
            message["reasoning"] = self.reasoning
        return message


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_tokens: int | None = Field(None, ge=1, description="prompt tokens + max_tokens must fit max_model_len")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="at most the server's --max-logprobs (default 20)")
    add_generation_prompt: bool = True
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: NoList | None = None
    function_call: Literal["none"] | None = None
    # False: at most one call when tool_choice is "required".
    parallel_tool_calls: bool | None = None
    # The chat template's inputs (vLLM's extensions; reasoning_effort is OpenAI's).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template: None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # Chat's prompt comes from the template, which holds any BOS: off by default (as vLLM).
    add_special_tokens: bool = False
    # With the prompt's last message answered by the same role: its content starts the reply.
    echo: bool = False
    # OpenAI's fields with no effect here (see IGNORED_FIELDS and NOOP_FIELDS).
    store: bool | None = None
    audio: None = None
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = None
    prediction: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    # Default: True for a prompt, False for messages (the chat template holds any BOS).
    add_special_tokens: bool | None = None
    # With messages: the chat template's inputs, as /v1/chat/completions takes them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list["ChatTool"], Field(max_length=128)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    reasoning_effort: ReasoningEffort | None = None


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


class PromptLogprob(OpenAIModel):
    """One token's entry at a prompt position (vLLM's shape): ``rank`` 1 is the likeliest token
    (the prompt token's counts every token at least as likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first is null: nothing precedes it), token id -> its entry.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _without_null_prompt_logprobs(handler: SerializerFunctionWrapHandler, model: BaseModel) -> dict[str, Any]:
    # Present only when asked for, so ordinary responses and stream chunks keep their shape.
    data = handler(model)
    if data.get("prompt_logprobs", 0) is None:
        del data["prompt_logprobs"]
    return data


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null_prompt_logprobs(handler, self)


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


class ResponseFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ResponseToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class DeltaToolCall(OpenAIModel):
    """A streamed piece of tool call ``index``: the first carries id, type and name; the
    ``function.arguments`` of all pieces concatenate to the call's arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ResponseFunctionCall

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    # The model's thinking, split from content by the server's --reasoning-parser.
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


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
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null_prompt_logprobs(handler, self)


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

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
    parent: str | None = None  # a LoRA adapter's base model
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


SamplingRequest.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
TokenizeRequest.model_rebuild()
