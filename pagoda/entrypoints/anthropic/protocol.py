"""Request and response bodies of Anthropic's Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``), as pydantic models.

Known fields are strictly typed and bounded (a boolean is not a number, ``max_tokens`` is at
least 1, an image block is refused by its type). Unknown fields, at any level, are ignored
with one warning per request in the server log naming them (the server's ``FieldPolicy``; a 400
with ``--strict-request-fields``): clients of this API send newer fields (``container``,
``mcp_servers``, ``cache_control`` on blocks, ...) that mean nothing to a self-hosted model.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagoda.engine.input_processor import MAX_MESSAGES
from pagoda.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE

MAX_TOOLS = 128


class MessagesRequestModel(BaseModel):
    """A request part: strict types; a field not declared is kept in ``model_extra`` until
    the server's ``FieldPolicy`` removes it (with a warning)."""

    model_config = ConfigDict(extra="allow", strict=True)


class MessagesResponseModel(BaseModel):
    """A response part (built by the server)."""

    model_config = ConfigDict(extra="ignore")


# ---- request content blocks ----------------------------------------------------------------

class TextBlockParam(MessagesRequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(MessagesRequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockParam(MessagesRequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlockParam(MessagesRequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(MessagesRequestModel):
    type: Literal["redacted_thinking"]
    data: str


class Base64ImageSource(MessagesRequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLImageSource(MessagesRequestModel):
    """Fetched only from hosts in the server's --allowed-media-domains."""

    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlockParam(MessagesRequestModel):
    """An image in a user turn (pagoda.multimodal): base64 data or a URL; Anthropic's Files
    store (``file`` sources) is refused by its type."""

    type: Literal["image"]
    source: Annotated[Union[Base64ImageSource, URLImageSource], Field(discriminator="type")]


# Tagged by "type": an unsupported block (document, ...) is refused by its type.
ContentBlockParam = Annotated[Union[TextBlockParam, ImageBlockParam, ToolUseBlockParam, ToolResultBlockParam,
                                    ThinkingBlockParam, RedactedThinkingBlockParam], Field(discriminator="type")]


class MessageParam(MessagesRequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


# ---- tools -----------------------------------------------------------------------------------

class ToolParam(MessagesRequestModel):
    # The same name rule as the chat route's functions: the model writes it back.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceAuto(MessagesRequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(MessagesRequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(MessagesRequestModel):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(MessagesRequestModel):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


ThinkingDisplay = Literal["summarized", "omitted"]


class ThinkingEnabled(MessagesRequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: ThinkingDisplay | None = None


class ThinkingAdaptive(MessagesRequestModel):
    type: Literal["adaptive", "between_tools"]
    display: ThinkingDisplay | None = None


class ThinkingDisabled(MessagesRequestModel):
    type: Literal["disabled"]


# Accepted; a self-hosted reasoning model thinks as its chat template lets it (the thinking
# comes back in thinking blocks with --reasoning-parser).
ThinkingConfig = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled], Field(discriminator="type")]


class JSONOutputFormat(MessagesRequestModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(MessagesRequestModel):
    # Structured output: the reply's text is JSON matching the schema (a grammar, as the chat
    # route's response_format). effort is accepted and does nothing.
    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(MessagesRequestModel):
    user_id: str | None = None


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class CountTokensRequest(MessagesRequestModel):
    """What a prompt is made of: ``count_tokens`` renders it without generating."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlockParam] | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="prompt tokens + max_tokens must fit max_model_len")
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off; at most the vocabulary size")
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None


# ---- responses -------------------------------------------------------------------------------

class TextBlock(MessagesResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(MessagesResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    # Anthropic signs its thinking so that it can be checked when sent back; a self-hosted
    # model's thinking carries no signature (an empty one, as the SDK's type requires a string).
    signature: str = ""


class ToolUseBlock(MessagesResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[ThinkingBlock, TextBlock, ToolUseBlock]


class MessagesUsage(MessagesResponseModel):
    input_tokens: int
    output_tokens: int
    # Prompt tokens served from the prefix cache; input_tokens counts the others (Anthropic's
    # convention: the prompt is input + cache_read + cache_creation tokens).
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(MessagesResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(MessagesResponseModel):
    input_tokens: int


class MessagesErrorInfo(MessagesResponseModel):
    type: str
    message: str


class MessagesErrorResponse(MessagesResponseModel):
    type: Literal["error"] = "error"
    error: MessagesErrorInfo
