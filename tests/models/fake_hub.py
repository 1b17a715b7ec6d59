"""A stand-in for the Hugging Face Hub on 127.0.0.1, for ``HF_ENDPOINT``.

It answers the routes ``huggingface_hub.snapshot_download`` uses: the model info of a revision
(``/api/models/REPO[/revision/REV]``), the file listing (``/api/models/REPO/tree/REV``) and file
downloads (``HEAD``/``GET /REPO/resolve/REV/PATH`` with ``X-Repo-Commit``, ``ETag`` and
``Content-Length``), and the Hub's errors: 404 ``RepoNotFound``, 401/403 ``GatedRepo``, 404
``RevisionNotFound``. Every request is recorded, so a test can tell what was fetched, and that
an offline run fetched nothing.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    """One model repository: per revision name (branch or tag) a commit hash and its files."""

    revisions: dict[str, tuple[str, dict[str, bytes]]]
    # Tokens that may read a gated repository; None: not gated.
    gated_tokens: frozenset[str] | None = None

    def commit(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        for name, (sha, files) in self.revisions.items():
            if revision in (name, sha):
                return sha, files
        return None


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its path relative to it (a checkpoint made on disk)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def commit_sha(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's names)
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, repo: str) -> set[str]:
        """Paths of ``repo`` whose content was sent (GET on resolve)."""
        prefix = f"/{repo}/resolve/"
        with self._lock:
            return {p[len(prefix):].split("/", 1)[1] for m, p in self.requests if m == "GET" and p.startswith(prefix)}

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    # ---- routes ---------------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        with self._lock:
            self.requests.append(("GET" if body else "HEAD", path))
        api = path.startswith("/api/models/")
        rest = path[len("/api/models/"):] if api else path[1:]
        repo_id = next((r for r in sorted(self.repos, key=len, reverse=True) if rest.startswith(r + "/")
                        or rest == r), None)
        if repo_id is None:
            return self._error(req, 404, "RepoNotFound", "Repository not found")
        repo = self.repos[repo_id]
        if repo.gated_tokens is not None:
            token = (req.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if token not in repo.gated_tokens:
                status = 403 if token else 401
                return self._error(req, status, "GatedRepo", f"Access to model {repo_id} is restricted. You must "
                                   "have access to it and be authenticated to access it. Please log in.")
        tail = rest[len(repo_id):].lstrip("/")
        if api:
            return self._api(req, repo_id, repo, tail)
        kind, _, tail = tail.partition("/")
        revision, _, filename = tail.partition("/")
        if kind != "resolve":
            return self._error(req, 404, None, "Not found")
        return self._file(req, repo, revision, filename, body)

    def _api(self, req: BaseHTTPRequestHandler, repo_id: str, repo: FakeRepo, tail: str) -> None:
        if tail in ("", "revision/main") or tail.startswith("revision/"):
            found = repo.commit(tail.removeprefix("revision/") if tail else "main")
            if found is None:
                return self._error(req, 404, "RevisionNotFound", "Invalid rev id")
            sha, files = found
            return self._json(req, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                                    "gated": repo.gated_tokens is not None and "manual",
                                    "siblings": [{"rfilename": name} for name in sorted(files)]})
        if tail.startswith("tree/"):
            found = repo.commit(tail.removeprefix("tree/").split("/", 1)[0])
            if found is None:
                return self._error(req, 404, "RevisionNotFound", "Invalid rev id")
            return self._json(req, [{"type": "file", "path": name, "size": len(data), "oid": _blob_id(data)}
                                    for name, data in sorted(found[1].items())])
        return self._error(req, 404, None, "Not found")

    def _file(self, req: BaseHTTPRequestHandler, repo: FakeRepo, revision: str, filename: str,
              body: bool) -> None:
        found = repo.commit(revision)
        if found is None:
            return self._error(req, 404, "RevisionNotFound", "Invalid rev id")
        sha, files = found
        if filename not in files:
            return self._error(req, 404, "EntryNotFound", "Entry not found")
        data = files[filename]
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(data)))
        req.send_header("ETag", f'"{_blob_id(data)}"')
        req.send_header("X-Repo-Commit", sha)
        req.end_headers()
        if body:
            req.wfile.write(data)

    @staticmethod
    def _json(req: BaseHTTPRequestHandler, payload: object) -> None:
        data = json.dumps(payload).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    @staticmethod
    def _error(req: BaseHTTPRequestHandler, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        req.send_response(status)
        if code:
            req.send_header("X-Error-Code", code)
            req.send_header("X-Error-Message", message)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)
