"""The Files and Batch API's state and the batches' lifecycle.

A batch goes validating → in_progress → finalizing → completed; a batch whose input cannot be
read as batch lines goes to failed (with ``errors``); a cancelled one through cancelling to
cancelled; one not done within its completion window to expired. Lines that ran with a 200
go to the output file, every other line to the error file. Every object belongs to the tenant
that made it (``TenantPolicy``): other tenants see a 404.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from starlette.types import ASGIApp

from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.batch.protocol import (OUTPUT_PURPOSE, TERMINAL_STATUSES, Batch, BatchCreateRequest,
                                                      BatchError, BatchErrors, BatchRequestCounts, FileObject)
from pagoda.entrypoints.openai.batch.runner import (RETRIES, RETRY_DELAY_S, BatchGate, LineResponse, call_app,
                                                    batch_priority, line_body, line_error, result_line)
from pagoda.entrypoints.openai.batch.storage import BatchStorage
from pagoda.entrypoints.openai.serving_common import APIError
from pagoda.entrypoints.openai.tenants import TENANT_SCOPE_KEY, TenantPolicy

logger = logging.getLogger("pagoda.batch")

COMPLETION_WINDOW_S = 24 * 3600
DEFAULT_MAX_BATCH_FILE_BYTES = 100 << 20
DEFAULT_MAX_REQUESTS_PER_BATCH = 50_000
# The most validation errors a failed batch lists.
MAX_LISTED_ERRORS = 100


@dataclass
class BatchLimits:
    max_file_bytes: int = DEFAULT_MAX_BATCH_FILE_BYTES
    max_requests: int = DEFAULT_MAX_REQUESTS_PER_BATCH


@dataclass
class _Job:
    """A batch and what runs it."""

    batch: Batch
    owner: str
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    results_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one append at a time


@dataclass
class BatchLine:
    index: int
    custom_id: str
    url: str
    method: str
    body: dict[str, Any]


class BatchService:
    """Files, batches and the tasks that run them; ``attach`` the app before ``start``."""

    def __init__(self, engine: AsyncEngine | None, storage: BatchStorage, tenants: TenantPolicy, limits: BatchLimits,
                 max_concurrent: int, api_key: str | None, endpoints: tuple[str, ...]) -> None:
        # None: the lines go to several models' engines (a subclass sets its own gate and
        # line_priority: models_server.RoutedBatchService).
        self.engine = engine
        self.storage = storage
        self.tenants = tenants
        self.limits = limits
        self.gate = BatchGate(engine, max_concurrent)
        self.api_key = api_key
        self.endpoints = endpoints  # the batch endpoints this server serves
        self.app: ASGIApp | None = None
        self.files: dict[str, tuple[FileObject, str]] = {f.id: (f, owner) for f, owner in storage.load_files()}
        self.jobs: dict[str, _Job] = {b.id: _Job(b, owner) for b, owner, _ in storage.load_batches()}

    def attach(self, app: ASGIApp) -> None:
        self.app = app

    async def start(self) -> None:
        """Resume every batch a previous server left unfinished."""
        for job in self.jobs.values():
            if job.batch.status not in TERMINAL_STATUSES:
                if job.batch.status == "cancelling":
                    job.cancelled.set()
                logger.info("resuming batch %s (%s)", job.batch.id, job.batch.status)
                self._launch(job)

    async def close(self) -> None:
        """Stop the running batches where they are (a restart on the same directory resumes them)."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None and not job.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.storage.close()

    # ---- files ----

    def owner(self, raw: Any) -> str:
        return self.tenants.tenant(raw, None)

    def add_file(self, file_id: str, filename: str, size: int, purpose: str, owner: str) -> FileObject:
        file = FileObject(id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose=purpose)
        self.storage.save_file(file, owner)
        self.files[file_id] = (file, owner)
        return file

    def get_file(self, file_id: str, owner: str) -> FileObject:
        entry = self.files.get(file_id)
        if entry is None or entry[1] != owner:
            raise APIError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return entry[0]

    def list_files(self, owner: str, purpose: str | None) -> list[FileObject]:
        """Newest first."""
        files = [f for f, o in self.files.values() if o == owner and (purpose is None or f.purpose == purpose)]
        return sorted(files, key=lambda f: (f.created_at, f.id), reverse=True)

    def delete_file(self, file_id: str, owner: str) -> None:
        self.get_file(file_id, owner)
        busy = [j.batch.id for j in self.jobs.values()
                if j.batch.input_file_id == file_id and j.batch.status not in TERMINAL_STATUSES]
        if busy:
            raise APIError(409, f"the file is the input of batch {busy[0]}, which has not finished; cancel it or "
                                "wait for it first", param="file_id", code="file_in_use", type="conflict_error")
        self.storage.delete_file(file_id)
        del self.files[file_id]

    # ---- batches ----

    def create_batch(self, req: BatchCreateRequest, owner: str) -> Batch:
        file = self.get_file(req.input_file_id, owner)
        if file.purpose != "batch":
            raise APIError(400, f"the input file's purpose is {file.purpose!r}; a batch needs a file uploaded with "
                                "purpose 'batch'", param="input_file_id")
        if req.endpoint not in self.endpoints:
            raise APIError(400, f"this server does not serve {req.endpoint}; it serves {', '.join(self.endpoints)}",
                           param="endpoint")
        now = int(time.time())
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", endpoint=req.endpoint, input_file_id=file.id,
                      completion_window=req.completion_window, status="validating", created_at=now,
                      expires_at=now + COMPLETION_WINDOW_S, metadata=req.metadata)
        job = _Job(batch, owner)
        self.jobs[batch.id] = job
        self._save(job)
        self._launch(job)
        return batch

    def get_batch(self, batch_id: str, owner: str) -> Batch:
        return self._job(batch_id, owner).batch

    def list_batches(self, owner: str) -> list[Batch]:
        """Newest first."""
        batches = [j.batch for j in self.jobs.values() if j.owner == owner]
        return sorted(batches, key=lambda b: (b.created_at, b.id), reverse=True)

    def cancel_batch(self, batch_id: str, owner: str) -> Batch:
        job = self._job(batch_id, owner)
        batch = job.batch
        if batch.status in TERMINAL_STATUSES or batch.status == "finalizing":  # finalizing: every line has run
            raise APIError(409, f"the batch is {batch.status}; only a batch that is validating or in progress can "
                                "be cancelled", param="batch_id", code="batch_not_cancellable", type="conflict_error")
        if batch.status != "cancelling":
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
            self._save(job)
            job.cancelled.set()
        return batch

    def _job(self, batch_id: str, owner: str) -> _Job:
        job = self.jobs.get(batch_id)
        if job is None or job.owner != owner:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
        return job

    def _save(self, job: _Job) -> None:
        self.storage.save_batch(job.batch, job.owner)

    def _launch(self, job: _Job) -> None:
        job.task = asyncio.create_task(self._run(job), name=f"pagoda-{job.batch.id}")

    # ---- running ----

    async def _run(self, job: _Job) -> None:
        try:
            await self._run_job(job)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must fail the batch, not leave it in progress forever
            logger.exception("batch %s failed", job.batch.id)
            self._fail(job, [BatchError(code="internal_error", message="the batch failed on the server; see its log")])

    async def _run_job(self, job: _Job) -> None:
        batch = job.batch
        # Disk and JSON work of a whole file happen off the event loop: interactive requests
        # share it.
        lines, errors = await asyncio.to_thread(self._validate, batch)
        if errors:
            self._fail(job, errors)
            return
        if batch.status == "validating":
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
        batch.request_counts.total = len(lines)
        self._save(job)
        results = await asyncio.to_thread(self.storage.load_results, batch.id)
        self._count(batch, results)
        if batch.status == "in_progress":
            await self._run_lines(job, [line for line in lines if line.index not in results])
        results = await asyncio.to_thread(self.storage.load_results, batch.id)
        await self._finalize(job, lines, results)

    def _validate(self, batch: Batch) -> tuple[list[BatchLine], list[BatchError]]:
        """The input file's lines; errors that fail the whole batch (a line that is not a JSON
        object with a custom_id and a body, a custom_id given twice, too many lines)."""
        lines: list[BatchLine] = []
        errors: list[BatchError] = []
        seen: set[str] = set()
        for index, text in enumerate(self._input_lines(batch)):
            if not text.strip():
                continue
            line, error = parse_line(index, text)
            if line is not None and line.custom_id in seen:
                line, error = None, BatchError(code="duplicate_custom_id", param="custom_id", line=index + 1,
                                               message=f"custom_id {line.custom_id!r} is given more than once; "
                                                       "each line needs its own")
            if line is None:
                errors.append(error)  # type: ignore[arg-type]
            else:
                seen.add(line.custom_id)
                lines.append(line)
            if len(errors) >= MAX_LISTED_ERRORS or len(lines) > self.limits.max_requests:
                break
        if len(lines) > self.limits.max_requests:
            errors.append(BatchError(code="too_many_requests", message="the input file has more than "
                                     f"{self.limits.max_requests} requests, the most a batch may have "
                                     "(--max-requests-per-batch)"))
        elif not errors and not lines:
            errors.append(BatchError(code="empty_file", message="the input file has no request lines"))
        return lines, errors

    def _input_lines(self, batch: Batch) -> Iterator[str]:
        path = self.storage.content_path(batch.input_file_id)
        try:
            with open(path, encoding="utf-8", errors="replace") as src:
                yield from src
        except FileNotFoundError:
            return

    async def _run_lines(self, job: _Job, lines: list[BatchLine]) -> None:
        running: set[asyncio.Task] = set()
        try:
            for line in lines:
                if job.cancelled.is_set() or self._expired(job.batch) or not await self._acquire(job):
                    break
                task = asyncio.create_task(self._run_line(job, line))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()

    async def _acquire(self, job: _Job) -> bool:
        """Wait for room in the gate: True once a slot is held, False if the batch is cancelled first."""
        acquire = asyncio.ensure_future(self.gate.acquire())
        cancel = asyncio.ensure_future(job.cancelled.wait())
        try:
            await asyncio.wait({acquire, cancel}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancel.cancel()
            if not acquire.done():
                acquire.cancel()  # it holds no slot until it returns
        return acquire.done() and not acquire.cancelled()

    async def _run_line(self, job: _Job, line: BatchLine) -> None:
        try:
            response = await self._send(job, line)
        finally:
            self.gate.release()
        if response is None:  # cancelled while it ran: it has no result
            return
        result = result_line(line.custom_id, response)
        async with job.results_lock:
            await asyncio.to_thread(self.storage.append_result, job.batch.id, line.index, result)
        counts = job.batch.request_counts
        if response.status == 200:
            counts.completed += 1
        else:
            counts.failed += 1

    async def _send(self, job: _Job, line: BatchLine) -> LineResponse | None:
        if line.method != "POST":
            return line_error(400, f"method {line.method!r} is not supported; batch lines use POST", "method")
        if line.url != job.batch.endpoint:
            return line_error(400, f"url {line.url!r} is not this batch's endpoint {job.batch.endpoint!r}", "url",
                              "invalid_url")
        if line.body.get("stream"):
            return line_error(400, "stream is not supported in a batch line", "stream")
        assert self.app is not None, "attach() the app before running batches"
        headers = [(b"authorization", f"Bearer {self.api_key}".encode())] if self.api_key else []
        scope = {} if self.tenants.source == "user" else {TENANT_SCOPE_KEY: job.owner}
        body = line_body(line.body, self.line_priority(line.body))
        for attempt in range(RETRIES + 1):
            response = await call_app(self.app, line.url, body, headers, scope, job.cancelled)
            if job.cancelled.is_set() and response.status == 499:
                return None
            if response.status not in (429, 503) or attempt == RETRIES or job.cancelled.is_set():
                return response
            await asyncio.sleep(RETRY_DELAY_S)
        return response

    def line_priority(self, body: dict[str, Any]) -> int | None:
        """The ``priority`` a line is sent at (``batch_priority`` of its engine's policy)."""
        return batch_priority(self.engine.config.scheduler.policy)  # type: ignore[union-attr]

    # ---- endings ----

    def _count(self, batch: Batch, results: dict[int, dict[str, Any]]) -> None:
        ok = sum(1 for r in results.values() if r["response"] is not None and r["response"]["status_code"] == 200)
        batch.request_counts = BatchRequestCounts(total=batch.request_counts.total, completed=ok,
                                                  failed=len(results) - ok)

    def _expired(self, batch: Batch) -> bool:
        return batch.expires_at is not None and time.time() >= batch.expires_at

    async def _finalize(self, job: _Job, lines: list[BatchLine], results: dict[int, dict[str, Any]]) -> None:
        batch = job.batch
        now = int(time.time())
        expired = not job.cancelled.is_set() and len(results) < len(lines)
        if expired:  # the window ended first: the lines not run are errors, as OpenAI records them
            for line in lines:
                if line.index not in results:
                    results[line.index] = result_line(line.custom_id, None, {
                        "code": "batch_expired", "message": "this request could not be run before the batch expired"})
        if batch.status != "cancelling":
            batch.status, batch.finalizing_at = "finalizing", now
            self._save(job)
        ok = [results[i] for i in sorted(results) if _succeeded(results[i])]
        failed = [results[i] for i in sorted(results) if not _succeeded(results[i])]
        if ok or not failed:
            batch.output_file_id = await self._write_output(batch, "output", ok, job.owner)
        if failed:
            batch.error_file_id = await self._write_output(batch, "errors", failed, job.owner)
        self._count(batch, {i: r for i, r in results.items() if r["response"] is not None})
        batch.request_counts.failed += sum(1 for r in results.values() if r["response"] is None)
        now = int(time.time())
        if job.cancelled.is_set():
            batch.status, batch.cancelled_at = "cancelled", now
        elif expired:
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.completed_at = "completed", now
        self._save(job)
        self.storage.results_path(batch.id).unlink(missing_ok=True)  # only a resume needs it

    async def _write_output(self, batch: Batch, kind: str, results: list[dict[str, Any]], owner: str) -> str:
        file_id = f"file-{uuid.uuid4().hex}"
        size = await asyncio.to_thread(_write_lines, self.storage.content_path(file_id), results)
        self.add_file(file_id, f"{batch.id}_{kind}.jsonl", size, OUTPUT_PURPOSE, owner)
        return file_id

    def _fail(self, job: _Job, errors: list[BatchError]) -> None:
        job.batch.status, job.batch.failed_at = "failed", int(time.time())
        job.batch.errors = BatchErrors(data=errors)
        self._save(job)


def _write_lines(path: Path, results: list[dict[str, Any]]) -> int:
    with open(path, "w", encoding="utf-8") as out:
        for result in results:
            out.write(json.dumps(result) + "\n")
    return path.stat().st_size


def _succeeded(result: dict[str, Any]) -> bool:
    return result["response"] is not None and result["response"]["status_code"] == 200


def parse_line(index: int, text: str) -> tuple[BatchLine | None, BatchError | None]:
    """A line as a request, or the error that makes it unusable (``line`` is 1-based)."""
    number = index + 1
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, BatchError(code="invalid_json_line", message=f"line {number} is not valid JSON: {exc}",
                                line=number)
    if not isinstance(value, dict):
        return None, BatchError(code="invalid_json_line", message=f"line {number} is not a JSON object", line=number)
    custom_id, body = value.get("custom_id"), value.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return None, BatchError(code="missing_required_parameter", message=f"line {number} has no custom_id string",
                                param="custom_id", line=number)
    if not isinstance(body, dict):
        return None, BatchError(code="missing_required_parameter", message=f"line {number} has no body object",
                                param="body", line=number)
    url, method = value.get("url"), value.get("method")
    return BatchLine(index, custom_id, url if isinstance(url, str) else repr(url),
                 method if isinstance(method, str) else repr(method), body), None
