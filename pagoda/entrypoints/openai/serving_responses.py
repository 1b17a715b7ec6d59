"""``/v1/responses``: the OpenAI Responses API as a thin translator over chat completions.

A request becomes a ``ChatCompletionRequest`` (``instructions`` a system message first, input
items messages, function calls and their outputs the assistant's ``tool_calls`` and ``tool``
messages, ``text.format`` the ``response_format``), which ``ChatServing.prepare`` turns into the
engine prompt exactly as ``/v1/chat/completions`` would: same chat template, same tool plan and
grammars, same reasoning parser. The output is turned back into Responses items: a ``reasoning``
item (the reasoning parser's split), a ``message`` with ``output_text``, ``function_call`` items.

Responses are kept (``store``, the default) in a bounded in-memory LRU store
(``--max-stored-responses``), so that ``previous_response_id`` continues a conversation (the
stored conversation, then the new input; earlier ``instructions`` are not carried over, as
OpenAI does) and ``GET``/``DELETE`` find them. ``background`` runs a response detached: it is
polled with ``GET`` and stopped with ``POST .../cancel``. The store belongs to one server process
(with Ray replicas, each replica has its own).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagoda.engine.async_engine import RequestGroup
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall
from pagoda.entrypoints.openai.responses_protocol import (DeletedResponse, FunctionCallItem, FunctionCallOutputItem,
                                                          IncompleteDetails, InputImage, InputTokensDetails,
                                                          MessageItem,
                                                          OutputFunctionCall, OutputItem, OutputMessage,
                                                          OutputReasoning, OutputText, OutputTokensDetails,
                                                          ReasoningItem, ReasoningPart, ResponseError,
                                                          ResponseObject, ResponsesRequest, ResponseUsage)
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_common import (APIError, EventStream, error_responses, failure, rename_in_message,
                                                      usage_of, validation_error_of)
from pagoda.entrypoints.openai.structured import ToolPlan, ToolStreamer
from pagoda.outputs import CompletionOutput

DEFAULT_MAX_STORED_RESPONSES = 1000
# Chat names in an error -> the Responses request's field the client set.
_PARAMS = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text", "reasoning_effort": "reasoning"}


def add_responses_args(parser: Any) -> None:
    parser.add_argument("--max-stored-responses", type=_count, default=DEFAULT_MAX_STORED_RESPONSES,
                        help="responses kept in memory, each with its whole conversation, for "
                             "previous_response_id, GET and background runs (least recently used dropped first); "
                             "0 keeps none")


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be non-negative, got {value}")
    return value


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request -> chat conversation --------------------------------------------------------------

def input_messages(items: Any) -> list[dict[str, Any]]:
    """The chat messages of ``input``: a string is one user message; an earlier reply's reasoning
    goes to the next assistant message; consecutive function calls join one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item, index)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if reasoning is not None and messages and messages[-1]["role"] == "assistant" \
                and not isinstance(item, ReasoningItem):
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    return messages


def _content(item: MessageItem, index: int) -> str | list[dict[str, Any]]:
    """A message item's chat content: its text, or with images the chat route's text and
    ``image_url`` parts in their order."""
    if not item.has_images():
        return item.text()
    parts: list[dict[str, Any]] = []
    for part in item.content:  # type: ignore[union-attr]
        if isinstance(part, InputImage):
            if part.image_url is None:
                raise APIError(400, f"input[{index}]: an input_image needs image_url (a data: URL or an allowed "
                               "URL); file_id images are not supported", param="input")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            parts.append({"type": "text", "text": part.text})
    return parts


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the assistant turn of the conversation it continues."""
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if isinstance(item, OutputReasoning):
            turn["reasoning_content"] = "".join(p.text for p in item.content)
        elif isinstance(item, OutputMessage):
            turn["content"] = (turn["content"] or "") + "".join(p.text for p in item.content)
        elif isinstance(item, OutputFunctionCall):
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    if turn["content"] is None and not turn.get("tool_calls"):
        turn["content"] = ""
    return [turn]


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that generates what ``req`` asks for, over ``messages``."""
    body: dict[str, Any] = {"messages": messages, "model": req.model, "temperature": req.temperature,
                            "top_p": req.top_p, "max_completion_tokens": req.max_output_tokens,
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "user": req.user}  # the tenant, under --tenant-id-source user
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        body["reasoning_effort"] = effort  # handed to the chat template, as chat does
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise renamed(validation_error_of(exc.errors())) from exc


def renamed(error: APIError) -> APIError:
    """A chat error as the Responses client should read it: its field names, not chat's."""
    param = _PARAMS.get(error.param or "", error.param)
    if param is not None:  # every chat name of the field (a message may say max_tokens of max_completion_tokens)
        for chat_name in {error.param, *(n for n, name in _PARAMS.items() if name == param)} - {None, param}:
            error.message = rename_in_message(error.message, chat_name, param)
    error.param = param
    return error


# ---- output -> items and events ----------------------------------------------------------------

class ResponseBuilder:
    """One response's state: its output items as they grow, its status and usage, and the
    stream events that tell a client about each change (``sequence_number`` counts them)."""

    def __init__(self, serving: "ResponsesServing", req: ResponsesRequest, plan: ToolPlan, response_id: str,
                 model: str) -> None:
        self.req = req
        self.plan = plan
        self.reasoning_parser = serving.chat.reasoning
        self.thinker = (self.reasoning_parser.streamer(plan.reads_markers, plan.forced)
                        if self.reasoning_parser is not None else None)
        self.streamer = ToolStreamer(plan) if plan.mode != "none" else None
        self.id = response_id
        self.model = model
        self.status = "queued" if req.background else "in_progress"
        self.items: list[Any] = []
        self.open: int | None = None  # index of the item still being written
        self.calls: dict[int, int] = {}  # the tool streamer's call index -> output index
        self.usage: ResponseUsage | None = None
        self.error: ResponseError | None = None
        self.sequence = 0
        self.group: RequestGroup | None = None
        self.task: asyncio.Task | None = None  # a background run

    @property
    def summarize(self) -> bool:
        r = self.req.reasoning
        return r is not None and (r.summary or r.generate_summary) is not None

    def response(self) -> ResponseObject:
        req = self.req
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(
            req.tool_choice, str) else (req.tool_choice or "auto")
        return ResponseObject(
            id=self.id, status=self.status, model=self.model, output=[i.model_copy(deep=True) for i in self.items],
            usage=self.usage, error=self.error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if self.status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}},
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
            previous_response_id=req.previous_response_id, store=req.store, background=req.background,
            metadata=req.metadata or {}, user=req.user, truncation=req.truncation or "disabled")

    # -- the whole output at once (non-streamed) --
    def whole(self, c: CompletionOutput, group: RequestGroup) -> ResponseObject:
        parser, plan = self.reasoning_parser, self.plan
        reasoning, text = (parser.split(c.text, plan.reads_markers, plan.forced) if parser else (None, c.text))
        cut = c.finish_reason == "length"
        content, calls = (self.plan.result(text, cut) if self.plan.mode != "none" and text is not None
                          else (text, []))
        item_status = "incomplete" if c.finish_reason == "length" else "completed"
        if reasoning:
            self.items.append(self._reasoning_item(reasoning, item_status))
        if content:
            self.items.append(OutputMessage(id=_id("msg"), status=item_status, content=[OutputText(text=content)]))
        for call in calls:
            self.items.append(OutputFunctionCall(id=_id("fc"), call_id=call.id, name=call.function.name or "",
                                                 arguments=call.function.arguments or "", status=item_status))
        self._end(c.finish_reason, group)
        return self.response()

    def _reasoning_item(self, text: str, status: str) -> OutputReasoning:
        summary = [ReasoningPart(type="summary_text", text=text)] if self.summarize else []
        return OutputReasoning(id=_id("rs"), content=[ReasoningPart(text=text)], summary=summary, status=status)

    def _end(self, finish_reason: str | None, group: RequestGroup) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.usage = self._usage(group)

    def _usage(self, group: RequestGroup) -> ResponseUsage:
        usage = usage_of(group)
        ids = group.states[0].samples[0].token_ids
        thinking = 0
        if any(isinstance(i, OutputReasoning) for i in self.items):
            thinking = self.reasoning_parser.reasoning_tokens(ids)  # type: ignore[union-attr]
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                             total_tokens=usage.total_tokens, input_tokens_details=InputTokensDetails(
                                 cached_tokens=cached), output_tokens_details=OutputTokensDetails(
                                     reasoning_tokens=thinking))

    # -- streamed, delta by delta --
    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event, as OpenAI sends them: the type in ``event:`` and in the data."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def lifecycle(self, kind: str) -> str:
        return self.event(kind, response=self.response().model_dump())

    def feed(self, c: CompletionOutput) -> list[str]:
        """The events for one delta of the output."""
        final = c.finish_reason is not None
        reasoning, text = self.thinker.feed(c.text, final) if self.thinker is not None else (None, c.text)
        events = self._reasoning(reasoning) if reasoning else []
        calls: list[DeltaToolCall] = []
        if self.streamer is not None:
            cut = c.finish_reason == "length"
            text, calls = self.streamer.feed(text or "", final, cut) if text or final else (None, [])
        if text:
            events += self._text(text)
        for call in calls:
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, group: RequestGroup) -> list[str]:
        """The events that end the stream: the last item's done events, then the response's."""
        self._end(finish_reason, group)
        events = self.close()
        return events + [self.lifecycle("response.incomplete" if self.status == "incomplete"
                                        else "response.completed")]

    def fail(self, error: APIError) -> list[str]:
        self.status = "failed"
        self.error = ResponseError(code="server_error" if error.status >= 500 else "invalid_prompt",
                                   message=error.message)
        return self.close() + [self.lifecycle("response.failed")]

    def _start_item(self, item: Any) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=item.model_dump()))
        if not isinstance(item, OutputFunctionCall):
            part = item.content[0]
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=index,
                                     content_index=0, part=part.model_dump()))
        return events

    def close(self) -> list[str]:
        """Finish the item being written (its done events)."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.items[index]
        # An item cut short (max_output_tokens, a cancel, a failure) is incomplete.
        item.status = "incomplete" if self.status in ("incomplete", "cancelled", "failed") else "completed"
        where = {"item_id": item.id, "output_index": index}
        if isinstance(item, OutputFunctionCall):
            events = [self.event("response.function_call_arguments.done", **where, name=item.name,
                                 arguments=item.arguments)]
        else:
            part = item.content[0]
            done = (self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
                    if isinstance(item, OutputMessage) else
                    self.event("response.reasoning_text.done", **where, content_index=0, text=part.text))
            events = [done, self.event("response.content_part.done", **where, content_index=0,
                                       part=part.model_dump())]
            if isinstance(item, OutputReasoning) and self.summarize:
                events += self._summary(item, where)
        return events + [self.event("response.output_item.done", output_index=index, item=item.model_dump())]

    def _summary(self, item: OutputReasoning, where: dict[str, Any]) -> list[str]:
        """A requested summary's events (OpenAI's ``reasoning_summary_*``): the summary is the
        whole reasoning, known once it ends, so it comes in one delta."""
        text = item.content[0].text
        item.summary = [ReasoningPart(type="summary_text", text=text)]
        at = {**where, "summary_index": 0}
        return [self.event("response.reasoning_summary_part.added", **at, part={"type": "summary_text", "text": ""}),
                self.event("response.reasoning_summary_text.delta", **at, delta=text),
                self.event("response.reasoning_summary_text.done", **at, text=text),
                self.event("response.reasoning_summary_part.done", **at,
                           part={"type": "summary_text", "text": text})]

    def _open_kind(self) -> type | None:
        return type(self.items[self.open]) if self.open is not None else None

    def _reasoning(self, delta: str) -> list[str]:
        events = [] if self._open_kind() is OutputReasoning else self._start_item(
            OutputReasoning(id=_id("rs"), content=[ReasoningPart(text="")], status="in_progress"))
        item = self.items[self.open]  # type: ignore[index]
        item.content[0].text += delta
        return events + [self.event("response.reasoning_text.delta", item_id=item.id, output_index=self.open,
                                    content_index=0, delta=delta)]

    def _text(self, delta: str) -> list[str]:
        events = [] if self._open_kind() is OutputMessage else self._start_item(
            OutputMessage(id=_id("msg"), content=[OutputText(text="")], status="in_progress"))
        item = self.items[self.open]  # type: ignore[index]
        item.content[0].text += delta
        return events + [self.event("response.output_text.delta", item_id=item.id, output_index=self.open,
                                    content_index=0, delta=delta, logprobs=[])]

    def _call(self, call: DeltaToolCall) -> list[str]:
        events: list[str] = []
        if call.id is not None:
            events = self._start_item(OutputFunctionCall(id=_id("fc"), call_id=call.id,
                                                         name=call.function.name or "", status="in_progress"))
            self.calls[call.index] = len(self.items) - 1
        index = self.calls[call.index]
        item = self.items[index]
        delta = call.function.arguments or ""
        if delta:
            item.arguments += delta
            events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=index, delta=delta))
        return events


# ---- the store ---------------------------------------------------------------------------------

@dataclass
class Stored:
    """A kept response: its builder (the state, live while a background run goes on) and the
    conversation through its output, which a later ``previous_response_id`` continues."""

    builder: ResponseBuilder
    history: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    """At most ``max_size`` responses, the least recently used dropped first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        if self.max_size <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def pop(self, response_id: str) -> Stored | None:
        return self._items.pop(response_id, None)


# ---- the handlers ------------------------------------------------------------------------------

class ResponsesServing:
    """``/v1/responses`` over the chat handler (its prompt building, tools, reasoning parser)."""

    def __init__(self, chat: ChatServing, max_stored: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)
        self._tasks: set[asyncio.Task] = set()  # background runs (a reference keeps each alive)

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        self.chat.fields.check(req)  # unknown fields: a warning, or a 400 with --strict-request-fields
        self._check_modes(req)
        history = self._previous(req) + input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        chat_req = chat_request(req, system + history)
        try:
            prompt, plan = await self.chat.prepare(chat_req, raw)
            response_id = _id("resp")
            group = await self.chat.start(response_id, [prompt], "messages", {"prompt": "messages"})
        except APIError as exc:
            raise renamed(exc) from exc
        builder = ResponseBuilder(self, req, plan, response_id, self.chat.served_name(req.model))
        builder.group = group
        stored = Stored(builder, history)
        if req.background:
            self.store.put(response_id, stored)
            builder.task = asyncio.create_task(self._background(stored))
            self._tasks.add(builder.task)
            builder.task.add_done_callback(self._tasks.discard)
            return JSONResponse(builder.response().model_dump())
        if req.stream:
            return EventStream(self._stream(stored), on_close=group.abort)
        outputs = await self.chat.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        response = builder.whole(outputs[0].outputs[0], group)
        self._keep(stored)
        return JSONResponse(response.model_dump())

    def _check_modes(self, req: ResponsesRequest) -> None:
        if req.background and (not req.store or self.store.max_size <= 0):
            raise APIError(400, "background responses are polled from the store: they need store true (and a "
                           "server with --max-stored-responses above 0)", param="background")
        if req.background and req.stream:
            raise APIError(400, "background with stream is not supported: poll GET /v1/responses/{id} instead",
                           param="stream")

    def _previous(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation ``previous_response_id`` continues (none without it)."""
        if req.previous_response_id is None:
            return []
        stored = self.store.get(req.previous_response_id)
        if stored is None:
            raise APIError(400, f"previous response with id {req.previous_response_id!r} not found (responses are "
                           "kept in memory, the most recent --max-stored-responses of them)",
                           param="previous_response_id", code="previous_response_not_found")
        if stored.builder.status in ("queued", "in_progress"):
            raise APIError(400, f"previous response {req.previous_response_id!r} has not finished",
                           param="previous_response_id")
        return [dict(m) for m in stored.history]

    def _keep(self, stored: Stored) -> None:
        """Store a finished response with its conversation, when the request asked for it."""
        stored.history = stored.history + output_messages(stored.builder.items)
        stored.builder.group = None
        if stored.builder.req.store:
            self.store.put(stored.builder.id, stored)

    async def _stream(self, stored: Stored) -> AsyncIterator[str]:
        builder, group = stored.builder, stored.builder.group
        yield builder.lifecycle("response.created")
        yield builder.lifecycle("response.in_progress")
        try:
            reason = None
            async for _, out in group.changes():  # type: ignore[union-attr]
                for c in out.outputs:
                    reason = c.finish_reason or reason
                    for event in builder.feed(c):
                        yield event
            for event in builder.finish(reason, group):  # type: ignore[arg-type]
                yield event
            self._keep(stored)
        except Exception as exc:  # the engine died or refused: say so in-band
            for event in builder.fail(failure(exc)):
                yield event

    async def _background(self, stored: Stored) -> None:
        """Run a background response to its end (or its cancellation), updating its state."""
        builder, group = stored.builder, stored.builder.group
        builder.status = "in_progress"
        try:
            reason = None
            async for _, out in group.changes():  # type: ignore[union-attr]
                for c in out.outputs:
                    reason = c.finish_reason or reason
                    builder.feed(c)
            builder.finish(reason, group)  # type: ignore[arg-type]
            self._keep(stored)
        except asyncio.CancelledError:
            builder.status = "cancelled"
            builder.close()
        except Exception as exc:
            builder.fail(failure(exc))
        finally:
            await group.abort()  # type: ignore[union-attr]

    def get(self, response_id: str) -> Stored:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"no response with id {response_id!r} is stored here", param="response_id",
                           code="not_found")
        return stored

    async def cancel(self, response_id: str) -> ResponseObject:
        builder = self.get(response_id).builder
        if not builder.req.background:
            raise APIError(400, "only background responses can be cancelled", param="response_id")
        task = builder.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        return builder.response()

    async def delete(self, response_id: str) -> DeletedResponse:
        builder = self.get(response_id).builder
        self.store.pop(response_id)
        if builder.task is not None and not builder.task.done():
            builder.task.cancel()
        return DeletedResponse(id=response_id)


def responses_routes(serving: ResponsesServing, auth: tuple[int, ...]) -> APIRouter:
    """The routes of the Responses API (``auth``: (401,) when the server has an API key)."""
    router = APIRouter()
    generation = error_responses(400, *auth, 404, 413, 429, 500, 503)
    by_id = error_responses(400, *auth, 404, 500)

    @router.post("/v1/responses", response_model=None, responses={
        200: {"model": ResponseObject, "description": "The response; with \"stream\": true, server-sent events "
              "(response.created ... response.completed) whose data carries a sequence_number",
              "content": {"text/event-stream": {"schema": {"type": "object"}}}}, **generation})
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(req, raw)

    @router.get("/v1/responses/{response_id}", responses=by_id)
    async def get_response(response_id: str) -> ResponseObject:
        return serving.get(response_id).builder.response()

    @router.delete("/v1/responses/{response_id}", responses=by_id)
    async def delete_response(response_id: str) -> DeletedResponse:
        return await serving.delete(response_id)

    @router.post("/v1/responses/{response_id}/cancel", responses=by_id)
    async def cancel_response(response_id: str) -> ResponseObject:
        return await serving.cancel(response_id)

    return router
