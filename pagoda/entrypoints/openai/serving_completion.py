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

from pagoda.engine.async_engine import PromptInput, RequestGroup
from pagoda.entrypoints.openai.protocol import (MAX_PROMPTS_PER_REQUEST, MAX_SAMPLES_PER_REQUEST, CompletionChoice,
                                                CompletionLogprobs, CompletionRequest, CompletionResponse, Usage)
from pagoda.entrypoints.openai.serving_common import (SSE_DONE, EventStream, Serving,
                                                      completion_logprobs, failure, merge_completion_logprobs,
                                                      prompt_logprobs_body, sse, sse_error, usage_of)
from pagoda.entrypoints.openai.structured import guided_field, structured_params
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import check


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, one per engine request (none of them empty)."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)
    check(bool(prompts), "prompt", "prompt must not be empty")
    check(len(prompts) <= MAX_PROMPTS_PER_REQUEST, "prompt",
          f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS_PER_REQUEST} per request")
    check(all(len(p) > 0 for p in prompts), "prompt", "prompt must not be empty (nor contain an empty prompt)")
    return prompts


# With echo (and no prompt_logprobs of its own), prompt logprobs are what the request calls logprobs.
_ECHO_RENAMES = {"prompt_logprobs": "logprobs"}


def is_scoring(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: score the prompt (its text and logprobs), generate nothing.
    The engine still runs one decode step (a request samples at least one token); its token is
    dropped from the response and the usage."""
    return req.echo and req.max_tokens == 0


def as_scored(c: CompletionOutput) -> CompletionOutput:
    """A scoring request's choice: no completion, ended by its length of 0 once the engine is done."""
    return CompletionOutput(c.index, "", [], logprobs=[], finish_reason="length" if c.finished else None)


def engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    """The top-k the engine computes at each prompt position: what ``prompt_logprobs`` asks (not
    when streaming, where it is not sent) and, echoing, what ``logprobs`` shows of the prompt."""
    asked = req.prompt_logprobs if not req.stream else None
    echoed = req.logprobs if req.echo else None
    if asked is None or echoed is None:
        return asked if echoed is None else echoed
    return max(asked, echoed)


@dataclass
class _StreamState:
    """Per-choice bookkeeping of one streamed response."""

    finished: set[int] = field(default_factory=set)
    echoed: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.fields.check(req)
        prompts = await self._prompts(req)
        for prompt in prompts:
            prompt.lora_request = lora
        self.tag(prompts, req, raw)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        renames = dict(_ECHO_RENAMES) if req.prompt_logprobs is None else {}
        if req.response_format is not None and req.response_format.type != "text":
            renames["structured_outputs"] = "response_format"
        elif guided_field(req) is not None:
            renames["structured_outputs"] = guided_field(req)  # type: ignore[assignment]
        group = await self.start(request_id, prompts, "prompt", renames)
        if req.stream:
            return EventStream(self._stream(req, group, request_id), on_close=group.abort)
        outputs = await self.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        return JSONResponse(self._response(req, group, request_id, outputs).model_dump())

    async def _prompts(self, req: CompletionRequest) -> list[PromptInput]:
        try:
            prompts = split_prompts(req.prompt)
            check(len(prompts) * req.n <= MAX_SAMPLES_PER_REQUEST, "n",
                  f"{len(prompts)} prompts x n={req.n} samples exceed {MAX_SAMPLES_PER_REQUEST} per request")
            # Every text is bounded before any is tokenized: refusing costs no tokenizer time.
            for prompt in prompts:
                if isinstance(prompt, str):
                    self.engine.input_processor.check_text(len(prompt))
            return [await self._prompt_input(req, prompt) for prompt in prompts]
        except ValueError as exc:
            raise self.bad_request(exc, "prompt", _ECHO_RENAMES if req.prompt_logprobs is None else None) from exc

    async def _prompt_input(self, req: CompletionRequest, prompt: str | list[int]) -> PromptInput:
        if isinstance(prompt, str):
            text, ids = prompt, await self.engine.tokenize(prompt, req.add_special_tokens)
        else:
            text, ids = (self.engine.detokenize(prompt) if req.echo else None), prompt
        # Unset: the rest of the context (at least 1, so an over-long prompt is refused as such).
        max_tokens = req.max_tokens if req.max_tokens is not None else self.default_max_tokens(len(ids))
        if "max_tokens" not in req.model_fields_set and "max_tokens" in self.model_defaults:
            max_tokens = min(max_tokens, self.model_defaults["max_tokens"])  # OpenAI's 16, capped as vLLM caps it
        check(max_tokens > 0 or req.echo, "max_tokens",
              "max_tokens must be at least 1 (0 only with echo, to score the prompt)")
        check(not (req.stream and req.prompt_logprobs), "prompt_logprobs",
              "prompt_logprobs are not available when stream is true")
        params = req.sampling_params(max(max_tokens, 1), req.logprobs, engine_prompt_logprobs(req), self.model_defaults)
        params.structured_outputs = structured_params(req)  # response_format / structured_outputs / guided_*
        return PromptInput(text, ids, params)

    # ---- one response ----------------------------------------------------------------------
    def _response(self, req: CompletionRequest, group: RequestGroup, request_id: str,
                  outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                c = as_scored(c) if is_scoring(req) else c
                text, logprobs = self._choice_content(req, out, c, echo=req.echo, offset=0)
                prompt_lps = None
                if req.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs_body(out, req.prompt_logprobs, self.token_text)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_lps))
        return CompletionResponse(id=request_id, model=self.served_name(req.model), choices=choices,
                                  usage=self._usage(req, group))

    @staticmethod
    def _usage(req: CompletionRequest, group: RequestGroup) -> Usage:
        usage = usage_of(group)
        if is_scoring(req):  # the one token the engine sampled is not part of the response
            usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return usage

    def _choice_content(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, echo: bool,
                        offset: int) -> tuple[str, CompletionLogprobs | None]:
        """Text (with the prompt in front when echoing) and logprobs of one choice (or delta).

        Echoed, the prompt's tokens and logprobs come first (the first prompt token has no
        logprob: nothing precedes it), then the completion's, as OpenAI's completions API does.
        ``text_offset`` counts the characters of the token texts before each token, starting at
        ``offset``, one count over the prompt's tokens and the completion's (as vLLM's): it never
        goes back where a token's text is shorter than its share of the prompt (a byte of a
        character split over tokens)."""
        prompt_text = (out.prompt or "") if echo else ""
        text = prompt_text + c.text
        if req.logprobs is None:
            return text, None
        if not (echo and out.prompt_logprobs is not None):
            return text, completion_logprobs(c.token_ids, c.logprobs or [], self.token_text,
                                             offset + len(prompt_text))
        prompt_part = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.token_text, offset,
                                          req.logprobs)
        start = self._next_offset(offset, prompt_text, prompt_part)
        return text, merge_completion_logprobs(prompt_part, completion_logprobs(c.token_ids, c.logprobs or [],
                                                                                self.token_text, start))

    @staticmethod
    def _next_offset(offset: int, text: str, logprobs: CompletionLogprobs | None) -> int:
        """Where the next streamed delta's ``text_offset`` starts: after this delta's last token
        text (the emitted text can lag the tokens while a multi-byte character is incomplete)."""
        if logprobs is None:
            return offset + len(text)
        if not logprobs.tokens:
            return offset
        return logprobs.text_offset[-1] + len(logprobs.tokens[-1])

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, group: RequestGroup, request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        seen = _StreamState()
        model = self.served_name(req.model)
        try:
            async for i, out in group.changes():
                for c in out.outputs:
                    chunk = self._chunk(req, out, c, i * req.n + c.index, seen)
                    if chunk is not None:
                        usage = self._usage(req, group) if req.continuous_usage else None  # the counts so far
                        yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[chunk],
                                                     usage=usage))
            if req.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=self._usage(req, group)))
        except Exception as exc:  # the engine died or refused: tell the client in-band
            yield sse_error(failure(exc))
        yield SSE_DONE

    def _chunk(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
               seen: _StreamState) -> CompletionChoice | None:
        if index in seen.finished or (not c.token_ids and not c.text and c.finish_reason is None):
            return None
        echo = req.echo and index not in seen.echoed
        seen.echoed.add(index)
        c = as_scored(c) if is_scoring(req) else c
        text, logprobs = self._choice_content(req, out, c, echo, seen.offsets.get(index, 0))
        seen.offsets[index] = self._next_offset(seen.offsets.get(index, 0), text, logprobs)
        if c.finish_reason is not None:
            seen.finished.add(index)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)
