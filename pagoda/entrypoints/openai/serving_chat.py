"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, then
generation; the reply is the assistant message (or a stream of deltas)."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from pagoda.engine.async_engine import AsyncEngine, PromptInput, RequestGroup
from pagoda.engine.input_processor import chat_template_args
from pagoda.entrypoints.openai.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk,
                                                ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage,
                                                ChatStreamChoice, DeltaMessage, TokenizeRequest)
from pagoda.entrypoints.openai.reasoning import ReasoningParser
from pagoda.entrypoints.openai.serving_common import (SSE_DONE, EventStream, Serving,
                                                      chat_logprobs, failure, prompt_logprobs_body, sse,
                                                      sse_error, usage_of)
from pagoda.entrypoints.openai.structured import ToolPlan, ToolStreamer, guided_field, structured_params, tool_plan
from pagoda.entrypoints.openai.tool_parsers import get_tool_parser
from pagoda.multimodal.chat_parts import ImageRef, check_image_count, content_text, split_images
from pagoda.multimodal.inputs import ImageInput
from pagoda.multimodal.media import ImageLoader
from pagoda.outputs import CompletionOutput
from pagoda.sampling_params import ParamError, check

def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """What the chat template gets besides the messages and tools (``chat_template_args``, vLLM's
    semantics); ``ParamError`` for a combination that cannot render."""
    return chat_template_args(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                              req.documents, req.reasoning_effort)


async def render_chat(engine: AsyncEngine, req: ChatCompletionRequest | TokenizeRequest,
                      tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], str, list[ImageRef]]:
    """The request's checked messages, its prompt text through the chat template (an image
    part rendered as the model's placeholder) and its images' sources, in order (not loaded)."""
    # Roles, content parts, image count and total size are checked before the template or the
    # tokenizer does any work, and before any image is loaded: a text-only model refuses images
    # without fetching or decoding them.
    raw, images = split_images([m.template_input() for m in req.messages or []])
    check_image_count(len(images), engine.config.model, engine.config.media, "messages")
    messages = engine.input_processor.check_messages(raw)
    kwargs = template_kwargs(req)
    try:
        text = await engine.apply_chat_template(messages, req.add_generation_prompt, tools, **kwargs)
    except (TemplateError, TypeError) as exc:
        # The template refused what the request gave it (its raise_exception, or a template
        # variable of a type it cannot use): the request's fault, said as the template said it.
        param = "chat_template_kwargs" if req.chat_template_kwargs else "messages"
        raise ParamError(param, f"the chat template cannot render this request: {exc}") from exc
    return messages, text, images


async def prompt_ids(engine: AsyncEngine, loader: ImageLoader, text: str, images: list[ImageRef],
                     add_special_tokens: bool) -> tuple[list[int], dict[str, Any] | None, list[ImageInput]]:
    """The token ids of a rendered chat prompt, its ``multi_modal_data`` (None without images)
    and its preprocessed images. Images are loaded (``ParamError`` naming ``messages`` for a bad
    one), the prompt goes to the engine in vLLM's form, ``{"prompt": text, "multi_modal_data":
    {"image": [...]}}``, and the ids come back with each image's placeholder expanded to its
    feature count (what the prompt's length, and so the default ``max_tokens``, counts)."""
    if not images:
        return await engine.tokenize(text, add_special_tokens=add_special_tokens), None, []
    data = {"image": await loader.load_all([(ref.source, ref.where) for ref in images], "messages")}
    _, ids = await engine.tokenize_prompt({"prompt": text, "multi_modal_data": data})
    ids, processed = await engine.process_images(data, ids)
    return ids, data, processed


def echo_text(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """With ``echo``: the last message's content when the reply continues it (its role is the
    reply's: the assistant's, or any role's without a generation prompt), as vLLM does."""
    if not req.echo:
        return ""
    last = messages[-1]
    role = "assistant" if req.add_generation_prompt else last["role"]
    return content_text(last.get("content")) if last["role"] == role else ""


class ChatServing(Serving):
    def __init__(self, engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        super().__init__(engine, model_name)
        # The parser for tool_choice "auto" (resolve_tool_parser: named, or from the chat template).
        self.tool_call_parser = tool_call_parser
        # With --reasoning-parser: splits the thinking into reasoning_content; tools and
        # structured output apply to the answer after it.
        self.reasoning = reasoning_parser
        # Tool-argument schemas refuse undeclared properties (--no-strict-tool-arguments: off).
        self.strict_tool_arguments = True
        # Loads the images of requests (data: URLs; URLs and files only where the flags allow).
        self.images = ImageLoader(engine.config.media)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.fields.check(req)
        renames = self._renames(req)
        plan = self._tool_plan(req)
        prompt, echo = await self._prompt(req, renames, plan)
        prompt.lora_request = lora
        self.tag([prompt], req, raw)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.start(request_id, [prompt], "messages", renames)
        if req.stream:
            return EventStream(self._stream(req, group, request_id, plan, echo), on_close=group.abort)
        outputs = await self.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        choices = [self._choice(req, c, plan, echo) for c in outputs[0].outputs]
        prompt_lps = None
        if req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_body(outputs[0], req.prompt_logprobs, self.token_text)
        response = ChatCompletionResponse(id=request_id, model=self.served_name(req.model), choices=choices,
                                          usage=usage_of(group), prompt_logprobs=prompt_lps)
        return JSONResponse(response.model_dump())

    async def prepare(self, req: ChatCompletionRequest, raw: Request) -> tuple[PromptInput, ToolPlan]:
        """A chat request's engine prompt (adapter, tenant and cache salt included) and tool plan,
        made as ``create`` makes them; other APIs (Responses, Messages) translate their requests to chat and
        call this."""
        lora = self.check_model(req.model)
        plan = self._tool_plan(req)
        prompt, _ = await self._prompt(req, self._renames(req), plan)
        prompt.lora_request = lora
        self.tag([prompt], req, raw)
        return prompt, plan

    def _tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        parser = self.tool_call_parser
        try:
            plan = tool_plan(req, (lambda: get_tool_parser(parser)) if parser else None)
        except ValueError as exc:
            raise self.bad_request(exc, "tools") from exc
        plan.strict = self.strict_tool_arguments
        # The end-at-any-call grammar is Lark (llguidance); xgrammar keeps the closed JSON array.
        plan.stop_at_boundary = self.engine.config.structured_outputs_backend != "xgrammar"
        return plan

    def _choice(self, req: ChatCompletionRequest, c: CompletionOutput, plan: ToolPlan,
                echo: str = "") -> ChatCompletionChoice:
        reasoning, text = (self.reasoning.split(c.text, plan.reads_markers, plan.forced) if self.reasoning is not None
                           else (None, c.text))
        cut = c.finish_reason == "length"
        content, calls = plan.result(text, cut) if plan.mode != "none" and text is not None else (text, [])
        if echo:
            content = echo + (content or "")
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
        return ChatCompletionChoice(index=c.index, message=message,
                                    logprobs=self._logprobs(req, c), finish_reason=finish, stop_reason=c.stop_reason)

    @staticmethod
    def _renames(req: ChatCompletionRequest) -> dict[str, str]:
        """Engine parameter names -> the request field the client set."""
        renames = {"logprobs": "top_logprobs", "prompt": "messages"}
        if req.tool_choice == "required" or not isinstance(req.tool_choice, (str, type(None))):
            renames["structured_outputs"] = "tools"  # the grammar is built from the tools' schemas
        elif req.response_format is not None and req.response_format.type != "text":
            renames["structured_outputs"] = "response_format"
        elif guided_field(req) is not None:
            renames["structured_outputs"] = guided_field(req)  # type: ignore[assignment]
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames

    async def _prompt(self, req: ChatCompletionRequest, renames: dict[str, str],
                      plan: ToolPlan) -> tuple[PromptInput, str]:
        """The engine's prompt, and the text ``echo`` puts in front of each reply."""
        try:
            messages, text, images = await render_chat(self.engine, req, plan.template_tools)
            # The template already holds any BOS token: tokenizing adds another only if asked.
            ids, multi_modal_data, processed = await prompt_ids(self.engine, self.images, text, images,
                                                                req.add_special_tokens)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if max_tokens is None:
                max_tokens = self.default_max_tokens(len(ids))
            top = req.top_logprobs
            check(top is None or req.logprobs, "top_logprobs", "top_logprobs needs logprobs to be true")
            check(not (req.stream and req.prompt_logprobs), "prompt_logprobs",
                  "prompt_logprobs are not available when stream is true")
            prompt_logprobs = req.prompt_logprobs if not req.stream else None  # a stream does not carry them
            params = req.sampling_params(max_tokens, (top or 0) if req.logprobs else None, prompt_logprobs,
                                         self.model_defaults)
            # A forced tool call's grammar, or response_format / structured_outputs.
            params.structured_outputs = plan.constraint() or structured_params(req)
            if self.reasoning is not None and self.reasoning.reads_special_tokens:
                # Its markers are special tokens: decoded, so that the split can read (and drop) them.
                params.skip_special_tokens = False
            if self.reasoning is not None and params.structured_outputs is not None:
                # The grammar shapes the answer: it starts after the reasoning ends.
                self.reasoning.delay_grammar(params.structured_outputs, ids)
            prompt = PromptInput(text, ids, params, multi_modal_data=multi_modal_data, images=processed)
            return prompt, echo_text(req, messages)
        except ValueError as exc:
            raise self.bad_request(exc, "messages", renames) from exc

    def _logprobs(self, req: ChatCompletionRequest, c: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not req.logprobs:
            return None
        return ChatChoiceLogprobs(content=chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0,
                                                        self.token_text))

    async def _stream(self, req: ChatCompletionRequest, group: RequestGroup, request_id: str,
                      plan: ToolPlan, echo: str = "") -> AsyncIterator[str]:
        created = int(time.time())
        model = self.served_name(req.model)

        def chunk(choices: list[ChatStreamChoice], usage: object = None) -> str:
            if usage is None and req.continuous_usage:
                usage = usage_of(group)  # the counts so far, in every chunk
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                           usage=usage))

        finished: set[int] = set()
        streamers = {i: ToolStreamer(plan) for i in range(req.n)} if plan.mode != "none" else {}
        thinkers = ({i: self.reasoning.streamer(plan.reads_markers, plan.forced) for i in range(req.n)}
                    if self.reasoning is not None else {})
        try:
            # OpenAI streams open with the role, before any content.
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(req.n)])
            if echo:
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=echo)) for i in range(req.n)])
            async for _, out in group.changes():
                for c in out.outputs:
                    if c.index in finished or (not c.token_ids and not c.text and c.finish_reason is None):
                        continue
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    reason, final = c.finish_reason, c.finish_reason is not None
                    thinker = thinkers.get(c.index)
                    reasoning, text = thinker.feed(c.text, final) if thinker is not None else (None, c.text)
                    delta = DeltaMessage(content=text, reasoning_content=reasoning)
                    streamer = streamers.get(c.index)
                    if streamer is not None:
                        # Only the answer goes to the tool parser (a named call starts with it).
                        content, calls = (streamer.feed(text or "", final, reason == "length") if text or final
                                          else (None, []))
                        delta = DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
                        if streamer.made_calls and reason == "stop":
                            reason = "tool_calls"
                    if (streamer is not None or thinker is not None) and delta.content is None \
                            and not delta.tool_calls and reasoning is None and reason is None and not req.logprobs:
                        continue  # held back: maybe the start of a tool call or a tag
                    yield chunk([ChatStreamChoice(index=c.index, delta=delta, logprobs=self._logprobs(req, c),
                                                  finish_reason=reason, stop_reason=c.stop_reason)])
            if req.include_usage:
                yield chunk([], usage_of(group))
        except Exception as exc:  # the engine died or refused: tell the client in-band
            yield sse_error(failure(exc))
        yield SSE_DONE
