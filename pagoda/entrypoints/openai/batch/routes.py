"""The Files and Batch API's routes (``/v1/files``, ``/v1/batches``) and ``pagoda serve`` flags."""
from __future__ import annotations

import argparse
import uuid
from typing import Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, Response

from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.batch.protocol import (BATCH_ENDPOINTS, UPLOAD_PURPOSES, Batch, BatchCreateRequest,
                                                      BatchList, FileDeleted, FileList, FileObject)
from pagoda.entrypoints.openai.batch.runner import DEFAULT_MAX_CONCURRENT_BATCH_REQUESTS
from pagoda.entrypoints.openai.batch.service import (DEFAULT_MAX_BATCH_FILE_BYTES, DEFAULT_MAX_REQUESTS_PER_BATCH,
                                                     BatchLimits, BatchService)
from pagoda.entrypoints.openai.batch.storage import BatchStorage
from pagoda.entrypoints.openai.protocol import ErrorResponse
from pagoda.entrypoints.openai.serving_common import APIError, FieldPolicy, error_responses
from pagoda.entrypoints.openai.tenants import TenantPolicy
from pagoda.entrypoints.argtypes import positive_int as _positive_int, byte_size as _size

# What a multipart upload may add around the file itself (boundaries, part headers, purpose).
MULTIPART_OVERHEAD_BYTES = 64 << 10
_COPY_CHUNK = 1 << 20
_CONFLICT = {409: {"model": ErrorResponse, "description": "The object is in a state that does not allow this"}}


def batch_routes(service: BatchService, auth: tuple[int, ...], fields: FieldPolicy) -> APIRouter:
    """The routes; the caller puts them behind the API key."""
    router = APIRouter()
    _file_routes(router, service, auth)
    _batches_routes(router, service, auth, fields)
    return router


def _file_routes(router: APIRouter, service: BatchService, auth: tuple[int, ...]) -> None:
    @router.post("/v1/files", responses=error_responses(400, *auth, 413, 500))
    async def upload_file(raw: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> FileObject:
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose {purpose!r} is not supported; this server stores files for "
                                f"{', '.join(UPLOAD_PURPOSES)}", param="purpose")
        file_id = f"file-{uuid.uuid4().hex}"
        size = await _store(service, file, file_id)
        return service.add_file(file_id, file.filename or "upload.jsonl", size, purpose, service.owner(raw))

    @router.get("/v1/files", responses=error_responses(400, *auth, 500))
    async def list_files(raw: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000),
                         order: Literal["asc", "desc"] = "desc") -> FileList:
        files = service.list_files(service.owner(raw), purpose)
        if order == "asc":
            files.reverse()
        page, more = _page(files, after, limit)
        return FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                        has_more=more)

    @router.get("/v1/files/{file_id}", responses=error_responses(*auth, 404, 500))
    async def get_file(file_id: str, raw: Request) -> FileObject:
        return service.get_file(file_id, service.owner(raw))

    @router.get("/v1/files/{file_id}/content", response_class=FileResponse,
                responses={200: {"content": {"application/jsonl": {}}}, **error_responses(*auth, 404, 500)})
    async def file_content(file_id: str, raw: Request) -> Response:
        file = service.get_file(file_id, service.owner(raw))
        return FileResponse(service.storage.content_path(file.id), media_type="application/jsonl",
                            filename=file.filename)

    @router.delete("/v1/files/{file_id}", responses={**error_responses(*auth, 404, 500), **_CONFLICT})
    async def delete_file(file_id: str, raw: Request) -> FileDeleted:
        service.delete_file(file_id, service.owner(raw))
        return FileDeleted(id=file_id)


def _batches_routes(router: APIRouter, service: BatchService, auth: tuple[int, ...], fields: FieldPolicy) -> None:
    @router.post("/v1/batches", responses=error_responses(400, *auth, 404, 500))
    async def create_batch(req: BatchCreateRequest, raw: Request) -> Batch:
        fields.check(req)
        return service.create_batch(req, service.owner(raw))

    @router.get("/v1/batches", responses=error_responses(400, *auth, 500))
    async def list_batches(raw: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=100)) -> BatchList:
        page, more = _page(service.list_batches(service.owner(raw)), after, limit)
        return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                         has_more=more)

    @router.get("/v1/batches/{batch_id}", responses=error_responses(*auth, 404, 500))
    async def get_batch(batch_id: str, raw: Request) -> Batch:
        return service.get_batch(batch_id, service.owner(raw))

    @router.post("/v1/batches/{batch_id}/cancel", responses={**error_responses(*auth, 404, 500), **_CONFLICT})
    async def cancel_batch(batch_id: str, raw: Request) -> Batch:
        return service.cancel_batch(batch_id, service.owner(raw))


async def _store(service: BatchService, upload: UploadFile, file_id: str) -> int:
    """Copy an upload into the store; a 413 (and nothing kept) past ``--max-batch-file-bytes``."""
    limit = service.limits.max_file_bytes
    path = service.storage.content_path(file_id)
    size = 0
    try:
        with open(path, "wb") as out:
            while chunk := await upload.read(_COPY_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the file is larger than the server's limit of {limit} bytes "
                                        "(--max-batch-file-bytes)", param="file", code="file_too_large")
                out.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return size


def _page(items: list[Any], after: str | None, limit: int) -> tuple[list[Any], bool]:
    """The ``limit`` items after the one whose id is ``after`` (from the start when it is none
    or unknown), and whether more follow."""
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.id == after), 0)
    page = items[start:start + limit]
    return page, start + limit < len(items)


# ---- pagoda serve ----------------------------------------------------------------------------

def add_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-storage-dir", default=None,
                        help="directory of the Files and Batch API's files and batches; a server restarted on the "
                             "same directory resumes its unfinished batches (default: a temporary directory, "
                             "removed when the server stops)")
    parser.add_argument("--max-batch-file-bytes", type=_size, default=DEFAULT_MAX_BATCH_FILE_BYTES,
                        help="largest file POST /v1/files takes (bytes, or 100MiB); larger uploads get 413")
    parser.add_argument("--max-requests-per-batch", type=_positive_int, default=DEFAULT_MAX_REQUESTS_PER_BATCH,
                        help="most request lines in one batch's input file; a batch with more fails validation")
    parser.add_argument("--max-concurrent-batch-requests", type=_positive_int,
                        default=DEFAULT_MAX_CONCURRENT_BATCH_REQUESTS,
                        help="batch lines that run at once, across all batches; a line starts only while the "
                             "engine has a free sequence and no request waits, so interactive requests find room")


def build_batch_service(args: argparse.Namespace, engine: AsyncEngine, tenants: TenantPolicy,
                        embeddings: bool) -> BatchService:
    """The server's batch service from its flags (raises ``StorageInUseError`` or ``OSError``)."""
    storage = BatchStorage(getattr(args, "batch_storage_dir", None))
    limits = BatchLimits(getattr(args, "max_batch_file_bytes", DEFAULT_MAX_BATCH_FILE_BYTES),
                         getattr(args, "max_requests_per_batch", DEFAULT_MAX_REQUESTS_PER_BATCH))
    endpoints = tuple(e for e in BATCH_ENDPOINTS if embeddings or e != "/v1/embeddings")
    return BatchService(engine, storage, tenants, limits,
                        getattr(args, "max_concurrent_batch_requests", DEFAULT_MAX_CONCURRENT_BATCH_REQUESTS),
                        args.api_key, endpoints)


def upload_body_limit(service: BatchService) -> int:
    """The request-body limit of ``POST /v1/files``: the file's, plus the multipart envelope."""
    return service.limits.max_file_bytes + MULTIPART_OVERHEAD_BYTES


