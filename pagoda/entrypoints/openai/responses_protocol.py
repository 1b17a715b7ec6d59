"""Request and response bodies of the OpenAI Responses API (``/v1/responses``), as pydantic models.

Known fields are strictly typed and bounded like the chat request's (the sampling bounds come from
``pagoda.sampling_params``). Fields pagoda does not know are ignored with one warning per request
naming them (the server's ``FieldPolicy``; a 400 with ``--strict-request-fields``): clients of this API send many (``include``, ``service_tier``, ``prompt_cache_key``,
...) that mean nothing to a self-hosted server. Input content other than text and images (files, audio)
and tools other than functions are refused with a 400 naming the item.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pagoda.engine.input_processor import MAX_MESSAGES
from pagoda.entrypoints.openai.protocol import OpenAIModel
from pagoda.sampling_params import MAX_TEMPERATURE


class ResponsesRequestModel(BaseModel):
    """A request part: strict types; an undeclared field is kept in ``model_extra`` until the
    server's ``FieldPolicy`` removes it (a warning naming it, or a 400 with
    ``--strict-request-fields``)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


# ---- input items -------------------------------------------------------------------------------

class InputText(ResponsesRequestModel):
    """Text content: ``input_text`` from the client, ``output_text`` when an earlier reply's
    message is sent back as input."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(ResponsesRequestModel):
    """An image: ``image_url`` is a data: URL, or a URL the server's media flags allow (as the
    chat route's image_url parts). ``detail`` is accepted and ignored; ``file_id`` (OpenAI's
    Files store) is not supported."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1)] | None = None
    file_id: str | None = None
    detail: str | None = None


# Tagged by "type": files and audio are refused by their type.
InputContent = Annotated[Union[InputText, InputImage], Field(discriminator="type")]


class MessageItem(ResponsesRequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, InputText))

    def has_images(self) -> bool:
        return not isinstance(self.content, str) and any(isinstance(p, InputImage) for p in self.content)


class FunctionCallItem(ResponsesRequestModel):
    """A call the model made earlier (as an earlier response's output gave it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(ResponsesRequestModel):
    """The client's result of running a call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(ResponsesRequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(ResponsesRequestModel):
    """An earlier reply's reasoning, sent back: it goes to the next assistant turn's
    ``reasoning_content`` (templates that show earlier thinking read it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


def _item_kind(value: Any) -> str | None:
    # A message may leave out its type ({"role": "user", "content": "..."}, the SDK's EasyInputMessage).
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind)]


# ---- tools, formats ----------------------------------------------------------------------------

class FunctionTool(ResponsesRequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# Tagged by "type": hosted tools (web_search, file_search, ...) are refused by their type.
Tool = Annotated[Union[FunctionTool], Field(discriminator="type")]


class FunctionToolChoice(ResponsesRequestModel):
    type: Literal["function"]
    name: str


class TextFormatPlain(ResponsesRequestModel):
    type: Literal["text"]


class TextFormatJsonObject(ResponsesRequestModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(ResponsesRequestModel):
    type: Literal["json_schema"]
    name: str = Field(max_length=64)
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Union[TextFormatPlain, TextFormatJsonObject, TextFormatJsonSchema],
                       Field(discriminator="type")]


class TextConfig(ResponsesRequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; no effect


class ReasoningConfig(ResponsesRequestModel):
    """Accepted; the reasoning a model writes is returned whatever these say (``summary`` set:
    the whole reasoning also fills the item's ``summary``)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# ---- the request -------------------------------------------------------------------------------

class ResponsesRequest(ResponsesRequestModel):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="prompt tokens + this must fit max_model_len")
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # accepted; too long a conversation is a 400


# ---- the response ------------------------------------------------------------------------------

class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningPart(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"] = "reasoning_text"
    text: str


class OutputReasoning(OpenAIModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputFunctionCall(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Annotated[Union[OutputReasoning, OutputMessage, OutputFunctionCall], Field(discriminator="type")]


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIModel):
    code: str
    message: str


class ResponseObject(OpenAIModel):
    """One response, as POST returns it, GET reads it back and the stream's lifecycle events
    carry it. (``output_text`` is the SDK's own property over ``output``.)"""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "queued", "cancelled", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    truncation: str = "disabled"


class DeletedResponse(OpenAIModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
