"""Where the Files and Batch API keep their state: one directory on local disk.

Layout: ``files/<id>.jsonl`` (a file's bytes) beside ``files/<id>.json`` (its object and owner),
``batches/<id>.json`` (a batch's object and owner) and ``batches/<id>.results.jsonl`` (each
finished line's result as it finishes, so a restarted server resumes a batch where it stopped).
Metadata is written to a temporary name and renamed: a crash leaves the old or the new record,
never half of one. One server at a time owns a directory (an exclusive ``flock``).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from pagoda.entrypoints.openai.batch.protocol import Batch, FileObject


class StorageInUseError(RuntimeError):
    """Another running server owns the storage directory."""


class BatchStorage:
    """The directory's records. ``root`` None: a private temporary directory, removed by
    ``close`` (nothing outlives the server)."""

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.temporary = root is None
        self.root = Path(tempfile.mkdtemp(prefix="pagoda-batch-")) if root is None else Path(root).expanduser()
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock.close()
            raise StorageInUseError(f"another pagoda server uses the batch storage directory {self.root}") from exc

    def close(self) -> None:
        self._lock.close()  # releases the flock
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- files ----

    def content_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def save_file(self, file: FileObject, owner: str) -> None:
        _write_json(self.files_dir / f"{file.id}.json", {"owner": owner, "file": file.model_dump()})

    def delete_file(self, file_id: str) -> None:
        for path in (self.content_path(file_id), self.files_dir / f"{file_id}.json"):
            path.unlink(missing_ok=True)

    def load_files(self) -> Iterator[tuple[FileObject, str]]:
        for path in self.files_dir.glob("*.json"):
            record = _read_json(path)
            if record is not None and self.content_path(path.stem).exists():
                yield FileObject.model_validate(record["file"]), record["owner"]

    # ---- batches ----

    def results_path(self, batch_id: str) -> Path:
        return self.batches_dir / f"{batch_id}.results.jsonl"

    def save_batch(self, batch: Batch, owner: str, extra: dict[str, Any] | None = None) -> None:
        _write_json(self.batches_dir / f"{batch.id}.json",
                    {"owner": owner, "batch": batch.model_dump(), **(extra or {})})

    def load_batches(self) -> Iterator[tuple[Batch, str, dict[str, Any]]]:
        for path in self.batches_dir.glob("*.json"):
            record = _read_json(path)
            if record is not None:
                yield Batch.model_validate(record.pop("batch")), record.pop("owner"), record

    def append_result(self, batch_id: str, line: int, result: dict[str, Any]) -> None:
        """Record one finished line (flushed before returning: a crash after it keeps it)."""
        with open(self.results_path(batch_id), "a", encoding="utf-8") as out:
            out.write(json.dumps({"line": line, "result": result}) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def load_results(self, batch_id: str) -> dict[int, dict[str, Any]]:
        """The lines recorded so far, by line index; a torn last line (a crash mid-write) is dropped."""
        results: dict[int, dict[str, Any]] = {}
        path = self.results_path(batch_id)
        if not path.exists():
            return results
        with open(path, encoding="utf-8") as src:
            for text in src:
                try:
                    entry = json.loads(text)
                except json.JSONDecodeError:
                    continue
                results[entry["line"]] = entry["result"]
        return results


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        json.dump(value, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
