"""The Files and Batch API's objects, in OpenAI's shapes (what the ``openai`` client parses)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictStr

from pagoda.entrypoints.openai.protocol import RequestModel

# The endpoints a batch line may call: the same routes that serve them online.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
# The statuses after which a batch never changes again.
TERMINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
# The file purposes this server stores: uploads for batches, and the results it writes.
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreateRequest(RequestModel):
    """``POST /v1/batches``. Metadata as OpenAI bounds it: at most 16 pairs, keys of at most
    64 characters, values of at most 512."""

    input_file_id: StrictStr = Field(min_length=1, max_length=128)
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = []


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = BatchRequestCounts()
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
