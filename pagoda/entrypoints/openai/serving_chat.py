"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, then
generation; the reply is the assistant message (or a stream of deltas)."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.async_engine import PromptInput, RequestGroup
from pagoda.entrypoints.openai.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk,
                                                ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage,
                                                ChatStreamChoice, DeltaMessage)
from pagoda.entrypoints.openai.serving_common import (SSE_DONE, EventStream, Serving,
                                                      chat_logprobs, failure, sse, sse_error,
                                                      usage_of)
from pagoda.outputs import CompletionOutput
from pagoda.sampling_params import check


class ChatServing(Serving):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        renames = self._renames(req)
        prompt = await self._prompt(req, renames)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.start(request_id, [prompt], "messages", renames)
        if req.stream:
            return EventStream(self._stream(req, group, request_id), on_close=group.abort)
        outputs = await self.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        choices = [ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                        logprobs=self._logprobs(req, c), finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason) for c in outputs[0].outputs]
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage_of(group))
        return JSONResponse(response.model_dump())

    @staticmethod
    def _renames(req: ChatCompletionRequest) -> dict[str, str]:
        """Engine parameter names -> the request field the client set."""
        renames = {"logprobs": "top_logprobs", "prompt": "messages"}
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames

    async def _prompt(self, req: ChatCompletionRequest, renames: dict[str, str]) -> PromptInput:
        try:
            # Roles, content parts and total size are checked before the template or the
            # tokenizer does any work.
            messages = self.engine.input_processor.check_messages([m.template_input() for m in req.messages])
            text = await self.engine.apply_chat_template(messages, req.add_generation_prompt)
            # The template already holds any BOS token: tokenizing must not add another.
            ids = await self.engine.tokenize(text, add_special_tokens=False)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if max_tokens is None:
                max_tokens = max(1, self.engine.max_model_len - len(ids))
            top = req.top_logprobs
            check(top is None or req.logprobs, "top_logprobs", "top_logprobs needs logprobs to be true")
            params = req.sampling_params(max_tokens, (top or 0) if req.logprobs else None)
            return PromptInput(text, ids, params)
        except ValueError as exc:
            raise self.bad_request(exc, "messages", renames) from exc

    def _logprobs(self, req: ChatCompletionRequest, c: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not req.logprobs:
            return None
        return ChatChoiceLogprobs(content=chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0,
                                                        self.token_text))

    async def _stream(self, req: ChatCompletionRequest, group: RequestGroup, request_id: str) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: object = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        finished: set[int] = set()
        try:
            # OpenAI streams open with the role, before any content.
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(req.n)])
            async for _, out in group.changes():
                for c in out.outputs:
                    if c.index in finished or (not c.token_ids and not c.text and c.finish_reason is None):
                        continue
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                  logprobs=self._logprobs(req, c), finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason)])
            if req.include_usage:
                yield chunk([], usage_of(group))
        except Exception as exc:  # the engine died or refused: tell the client in-band
            yield sse_error(failure(exc))
        yield SSE_DONE
