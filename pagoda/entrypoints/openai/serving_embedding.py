"""``POST /v1/embeddings`` (OpenAI's shape) for embedding models (``EngineConfig.pooler``).

Each input is its own engine request that runs its prompt's prefill only and ends with the
pooled final hidden state (``SamplingParams.pooling``); the requests share the engine's batches
with everyone else's. Normalisation and ``dimensions`` (Matryoshka truncation, then
normalising again) are applied here (``pagoda.pooling.finish_embedding``).
"""
from __future__ import annotations

import base64
import struct
import uuid
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from pagoda.engine.async_engine import AsyncEngine, PromptInput
from pagoda.entrypoints.openai.protocol import MAX_CACHE_SALT_CHARS, OpenAIModel, RequestModel, TokenId
from pagoda.entrypoints.openai.serving_common import Serving
from pagoda.outputs import RequestOutput
from pagoda.pooling import PoolerConfig, finish_embedding
from pagoda.sampling_params import SamplingParams, check

# The engine's names for what this API calls otherwise (in 400s).
_RENAMES = {"prompt": "input", "pooling": "input"}
# Inputs in one request (OpenAI's limit); each is its own engine request.
MAX_EMBEDDING_INPUTS = 2048

EmbeddingInput = (str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)]
                  | list[TokenId] | Annotated[list[list[TokenId]], Field(max_length=MAX_EMBEDDING_INPUTS)])


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="at most the model's hidden size")
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    add_special_tokens: bool = True  # vLLM's extension: for text inputs
    # vLLM's extension: embed only each input's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 values


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def split_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One prompt per engine request, none empty."""
    if isinstance(value, str):
        inputs: list = [value]
    elif value and all(isinstance(t, int) for t in value):
        inputs = [list(value)]  # type: ignore[arg-type]
    else:
        inputs = list(value)
    check(bool(inputs) and all(len(x) > 0 for x in inputs), "input",
          "input must not be empty (nor contain an empty string or token list)")
    return inputs


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingServing(Serving):
    def __init__(self, engine: AsyncEngine, model_name: str, pooler: PoolerConfig) -> None:
        super().__init__(engine, model_name)
        self.pooler = pooler

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.fields.check(req)
        prompts = await self._prompts(req)
        for prompt in prompts:
            prompt.lora_request = lora
        self.tag(prompts, req, raw)  # type: ignore[arg-type]  # (it reads user and cache_salt)
        request_id = f"embd-{uuid.uuid4().hex}"
        group = await self.start(request_id, prompts, "input", _RENAMES)
        outputs = await self.collect(group, raw)
        if isinstance(outputs, Response):
            return outputs
        return JSONResponse(self._response(req, request_id, outputs).model_dump())

    async def _prompts(self, req: EmbeddingRequest) -> list[PromptInput]:
        try:
            hidden = self.engine.config.model.hidden_size
            check(req.dimensions is None or req.dimensions <= hidden, "dimensions",
                  f"dimensions must be at most the model's hidden size {hidden}, got {req.dimensions}")
            inputs = split_inputs(req.input)
            for x in inputs:  # every text is bounded before any is tokenized
                if isinstance(x, str):
                    self.engine.input_processor.check_text(len(x), "input")
            params = SamplingParams(max_tokens=None, pooling=self.pooler.pooling_type, detokenize=False,
                                    truncate_prompt_tokens=req.truncate_prompt_tokens)
            return [PromptInput(x if isinstance(x, str) else None,
                                await self.engine.tokenize(x, req.add_special_tokens) if isinstance(x, str) else x,
                                params) for x in inputs]
        except ValueError as exc:
            raise self.bad_request(exc, "input", _RENAMES) from exc

    def _response(self, req: EmbeddingRequest, request_id: str, outputs: list[RequestOutput]) -> EmbeddingResponse:
        data = [EmbeddingData(index=i, embedding=encode_vector(
                    finish_embedding(out.embedding or [], self.pooler.normalize, req.dimensions), req.encoding_format))
                for i, out in enumerate(outputs)]
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return EmbeddingResponse(id=request_id, data=data, model=self.served_name(req.model),
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
