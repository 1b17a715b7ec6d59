"""``POST /v1/completions``: prompts (text or token ids, one or many) to completions.

Each prompt is its own engine request; with ``n`` samples per prompt, choice ``index`` is
``prompt_index * n + sample_index``, as OpenAI numbers them.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.core_client import PromptInput, RequestGroup
from pagoda.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                CompletionResponse)
from pagoda.entrypoints.openai.serving_common import (SSE_DONE, APIError, EventStream, Serving,
                                                      completion_logprobs, failure, merge_completion_logprobs, sse,
                                                      sse_error, usage_of)
from pagoda.outputs import CompletionOutput, RequestOutput


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, one per engine request."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


@dataclass
class _StreamState:
    """Per-choice bookkeeping of one streamed response."""

    finished: set[int] = field(default_factory=set)
    echoed: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = await self._prompts(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = await self.start(request_id, prompts, "prompt")
        if req.stream:
            return EventStream(self._stream(req, group, request_id), on_close=group.abort)
        outputs = await self.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        return JSONResponse(self._response(req, group, request_id, outputs).model_dump())

    async def _prompts(self, req: CompletionRequest) -> list[PromptInput]:
        try:
            prompts = split_prompts(req.prompt)
            logprobs = req.logprobs
            result = []
            for prompt in prompts:
                if isinstance(prompt, str):
                    text, ids = prompt, await self.engine.tokenize(prompt)
                else:
                    text, ids = (self.engine.detokenize(prompt) if req.echo else None), prompt
                max_tokens = req.max_tokens if req.max_tokens is not None else self.engine.max_model_len - len(ids)
                params = req.sampling_params(max_tokens, logprobs, logprobs if req.echo else None)
                result.append(PromptInput(text, ids, params))
            return result
        except ValueError as exc:
            raise self.bad_request(exc, "prompt") from exc

    # ---- one response ----------------------------------------------------------------------
    def _response(self, req: CompletionRequest, group: RequestGroup, request_id: str,
                  outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text, logprobs = self._choice_content(req, out, c, echo=req.echo, offset=0)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage_of(group))

    def _choice_content(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, echo: bool,
                        offset: int) -> tuple[str, CompletionLogprobs | None]:
        """Text (with the prompt in front when echoing) and logprobs of one choice (or delta)."""
        text = (out.prompt or "") + c.text if echo else c.text
        if req.logprobs is None:
            return text, None
        logprobs = completion_logprobs(c.token_ids, c.logprobs or [], self.token_text, offset + len(text) - len(c.text))
        if echo and out.prompt_logprobs is not None:
            prompt_part = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.token_text, offset)
            logprobs = merge_completion_logprobs(prompt_part, logprobs)
        return text, logprobs

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, group: RequestGroup, request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        seen = _StreamState()
        try:
            async for i, out in group.changes():
                for c in out.outputs:
                    chunk = self._chunk(req, out, c, i * req.n + c.index, seen)
                    if chunk is not None:
                        yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                     choices=[chunk]))
            if req.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                             usage=usage_of(group)))
        except Exception as exc:  # the engine died or refused: tell the client in-band
            yield sse_error(failure(exc))
        yield SSE_DONE

    def _chunk(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
               seen: _StreamState) -> CompletionChoice | None:
        if index in seen.finished or (not c.token_ids and not c.text and c.finish_reason is None):
            return None
        echo = req.echo and index not in seen.echoed
        seen.echoed.add(index)
        text, logprobs = self._choice_content(req, out, c, echo, seen.offsets.get(index, 0))
        seen.offsets[index] = seen.offsets.get(index, 0) + len(text)
        if c.finish_reason is not None:
            seen.finished.add(index)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)
