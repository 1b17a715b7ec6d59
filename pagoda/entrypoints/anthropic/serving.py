"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API as a
thin translator over the chat route.

A Messages request becomes the chat route's request (system prompt and content blocks become
chat messages, ``tool_use`` / ``tool_result`` become tool calls and tool messages, Anthropic's
``tool_choice`` the chat one: ``any`` is ``required``, ``tool`` a named function); the chat
route renders the template, builds the tool plan and sampling parameters, and the engine runs
it. Its output goes back through the same shared parsers (reasoning split, tool plan) and
leaves as Anthropic content blocks: ``thinking``, ``text``, ``tool_use``, or as Anthropic's
event stream (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per block,
``message_delta``, ``message_stop``).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from pagoda.engine.async_engine import PromptInput, RequestGroup
from pagoda.entrypoints.anthropic.protocol import (ContentBlock, CountTokensRequest, CountTokensResponse,
                                                   MessageParam, MessagesRequest, MessagesResponse, MessagesUsage,
                                                   TextBlock, ThinkingBlock, ToolUseBlock)
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_common import APIError, EventStream, failure, validation_error_of
from pagoda.entrypoints.openai.structured import ToolPlan, ToolStreamer
from pagoda.multimodal.chat_parts import anthropic_image_part
from pagoda.outputs import CompletionOutput

# Engine / chat parameter names -> the Messages field the client set.
RENAMES = {"stop": "stop_sequences", "prompt": "messages", "structured_outputs": "tools",
           "response_format": "output_config"}


def renames_of(chat_req: ChatCompletionRequest) -> dict[str, str]:
    """RENAMES for this request: a grammar comes from output_config.format or from the tools."""
    formatted = chat_req.response_format is not None
    return {**RENAMES, "structured_outputs": "output_config" if formatted else "tools"}


# count_tokens has no max_tokens; the chat request it renders through needs one.
_COUNT_MAX_TOKENS = 1

# Anthropic's error type for each status (its API's documented table).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- requests -> the chat route's request ---------------------------------------------------

def chat_messages(system: str | list | None, messages: list[MessageParam]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first; a user turn's
    ``tool_result`` blocks become ``tool`` messages (in their place among its text), an
    assistant turn's ``tool_use`` blocks its ``tool_calls`` and its ``thinking`` its
    ``reasoning_content``."""
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "\n".join(block.text for block in system)
        out.append({"role": "system", "content": text})
    for message in messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(message))
        else:
            out.extend(_user(message))
    return out


def _assistant(message: MessageParam) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for block in message.content:  # type: ignore[union-attr]
        if block.type == "text":
            text.append(block.text)
        elif block.type == "thinking":
            thinking.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif block.type == "image":
            raise APIError(400, "an assistant message cannot hold an image block", param="messages")
        # redacted_thinking: opaque to any model but Anthropic's; dropped.
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    return turn


def _user(message: MessageParam) -> list[dict[str, Any]]:
    """A user turn's chat messages: its text and image blocks as one user message (text, or the
    chat route's text and ``image_url`` parts in order when it holds images), with each
    ``tool_result`` as a tool message in its place."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in message.content:  # type: ignore[union-attr]
        if block.type == "text":
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            parts.append(anthropic_image_part(block.source.model_dump()))
        elif block.type == "tool_result":
            if parts:
                out.append({"role": "user", "content": _user_content(parts)})
                parts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            raise APIError(400, f"a user message cannot hold a {block.type} block", param="messages")
    if parts or not out:
        out.append({"role": "user", "content": _user_content(parts)})
    return out


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    choice = req.tool_choice
    if choice is None:
        return None, None
    parallel = None if choice.type == "none" or choice.disable_parallel_tool_use is None \
        else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat route's request for a Messages (or count_tokens) request."""
    choice, parallel = _tool_choice(req)
    fields: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req.system, req.messages),
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.input_schema}} for t in req.tools]
        if req.tools else None,
        "tool_choice": choice, "parallel_tool_calls": parallel,
        "max_tokens": req.max_tokens if isinstance(req, MessagesRequest) else _COUNT_MAX_TOKENS,
    }
    if isinstance(req, MessagesRequest):
        fields.update(stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
        if req.thinking is not None and req.thinking.type == "disabled":
            fields["chat_template_kwargs"] = {"enable_thinking": False}  # the templates' switch (Qwen3's)
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": fmt.json_schema}}
    else:
        # Counting renders the tools for the template but plans no call (so needs no tool parser).
        fields["tool_choice"] = "none" if req.tools else None
    if req.messages and req.messages[-1].role == "assistant":
        # A conversation that ends on the assistant's words is continued from them ("prefill").
        fields.update(add_generation_prompt=False, continue_final_message=True)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # a translated value the chat route refuses
        raise validation_error_of(exc.errors()) from exc


# ---- outputs -> content blocks ---------------------------------------------------------------

def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(c: CompletionOutput, made_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):  # a stop string matched (an int is a stop token: a turn's end)
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage_of(group: RequestGroup) -> MessagesUsage:
    state = group.states[0]
    cached = state.num_cached_tokens
    return MessagesUsage(input_tokens=len(state.prompt_token_ids) - cached,
                         output_tokens=sum(len(s.token_ids) for s in state.samples),
                         cache_read_input_tokens=cached)


def _arguments(text: str | None) -> dict[str, Any]:
    """A call's input: its arguments object, as much of it as was written when the call was cut
    short (what a client assembling the streamed ``input_json_delta`` pieces gets too)."""
    try:
        value = from_json(text or "{}", allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesServing:
    """The Messages API over the chat route's request building and the shared parsers."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest, raw: Request) -> CountTokensResponse:
        self.chat.fields.check(req)  # unknown fields: a warning, or a 400 with --strict-request-fields
        prompt, _ = await self._prepare(chat_request(req), raw)
        return CountTokensResponse(input_tokens=len(prompt.token_ids))

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        self.chat.fields.check(req)  # unknown fields: a warning, or a 400 with --strict-request-fields
        chat_req = chat_request(req)
        prompt, plan = await self._prepare(chat_req, raw)
        message_id = new_message_id()
        group = await self.chat.start(message_id, [prompt], "messages", renames_of(chat_req))
        model = self.chat.served_name(req.model)
        if req.stream:
            return EventStream(self._stream(group, message_id, model, plan), on_close=group.abort)
        outputs = await self.chat.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        c = outputs[0].outputs[0]
        content, made_calls = self._content(c, plan)
        reason, sequence = stop_reason(c, made_calls)
        message = MessagesResponse(id=message_id, content=content, model=model, stop_reason=reason,
                                   stop_sequence=sequence, usage=usage_of(group))
        return JSONResponse(message.model_dump())

    async def _prepare(self, chat_req: ChatCompletionRequest, raw: Request) -> tuple[PromptInput, ToolPlan]:
        """The chat route's prompt and tool plan (the same model check, template, grammar and
        checks); a refusal names the Messages field (``stop_sequences``, not ``stop``)."""
        try:
            return await self.chat.prepare(chat_req, raw)
        except APIError as exc:
            if exc.param is not None:
                exc.param = renames_of(chat_req).get(exc.param, exc.param)
            raise

    def _content(self, c: CompletionOutput, plan: ToolPlan) -> tuple[list[ContentBlock], bool]:
        """A finished output's blocks (and whether any is a tool call)."""
        reasoning = self.chat.reasoning
        thinking, text = (reasoning.split(c.text, plan.reads_markers, plan.forced) if reasoning is not None
                          else (None, c.text))
        blocks: list[ContentBlock] = [ThinkingBlock(thinking=thinking)] if thinking else []
        if plan.mode in ("auto", "required") and text is not None and c.finish_reason == "length":
            # Cut short: the calls as far as written, as a streamed reply shows them.
            end, partial = plan.scan_partial(text, final=False)
            content = text[:end] if text[:end].strip() else None
            uses = [(call.name, _arguments(call.arguments)) for call in partial if call.name is not None]
        else:
            content, calls = plan.result(text) if plan.mode != "none" and text is not None else (text, [])
            uses = [(call.function.name, _arguments(call.function.arguments)) for call in calls]
        if content:
            blocks.append(TextBlock(text=content))
        blocks += [ToolUseBlock(id=new_tool_use_id(), name=name, input=args) for name, args in uses]
        return blocks, bool(uses)

    async def _stream(self, group: RequestGroup, message_id: str, model: str,
                      plan: ToolPlan) -> AsyncIterator[str]:
        blocks = BlockStream()
        thinker = (self.chat.reasoning.streamer(plan.reads_markers, plan.forced) if self.chat.reasoning is not None
                   else None)
        tools = ToolStreamer(plan) if plan.mode != "none" else None
        started = False
        try:
            async for _, out in group.changes():
                c = out.outputs[0]
                if not started:  # after prefill: the prompt's cached part is known
                    started = True
                    yield _message_start(group, message_id, model)
                    yield event("ping", {"type": "ping"})
                final = c.finish_reason is not None
                thinking, text = thinker.feed(c.text, final) if thinker is not None else (None, c.text)
                for e in blocks.thinking(thinking):
                    yield e
                calls: list[DeltaToolCall] = []
                if tools is not None and (text or final):
                    # Cut by max_tokens: read as `_content` reads it (the call being written counts),
                    # however the output was split into changes.
                    text, calls = tools.feed(text or "", final and c.finish_reason != "length")
                for e in blocks.text(text):
                    yield e
                for call in calls:
                    for e in blocks.tool(call):
                        yield e
                if final:
                    for e in blocks.close():
                        yield e
                    reason, sequence = stop_reason(c, tools is not None and tools.made_calls)
                    yield event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                  "usage": usage_of(group).model_dump()})
                    yield event("message_stop", {"type": "message_stop"})
                    return
        except Exception as exc:  # the engine died or refused: tell the client in-band
            error = failure(exc)
            yield event("error", error_body(error.status, error.message))


def _message_start(group: RequestGroup, message_id: str, model: str) -> str:
    """The opening event: the message with no content yet, its prompt's usage."""
    usage = {**usage_of(group).model_dump(), "output_tokens": 0}
    return event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
        "stop_reason": None, "stop_sequence": None, "usage": usage}})


def event(name: str, data: dict[str, Any] | BaseModel) -> str:
    """One server-sent event with Anthropic's ``event:`` line."""
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"event: {name}\ndata: {body}\n\n"


class BlockStream:
    """Content blocks as a stream of events: a block starts when a delta of another kind
    arrives (thinking, text, or tool call ``index``) and stops when the next starts or the
    message ends."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def thinking(self, text: str | None) -> list[str]:
        if not text:
            return []
        out = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}) \
            if self.kind != "thinking" else []
        return out + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str | None) -> list[str]:
        if not text:
            return []
        out = self._open("text", {"type": "text", "text": ""}) if self.kind != "text" else []
        return out + [self._delta({"type": "text_delta", "text": text})]

    def tool(self, call: DeltaToolCall) -> list[str]:
        kind = f"tool_use:{call.index}"
        out = []
        if call.id is not None:  # a new call
            out = self._open(kind, {"type": "tool_use", "id": new_tool_use_id(), "name": call.function.name,
                                    "input": {}})
        if call.function.arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return out
