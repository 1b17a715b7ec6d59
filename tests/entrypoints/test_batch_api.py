"""The Files and Batch API (``/v1/files``, ``/v1/batches``) of a real ``pagoda serve`` through the
official ``openai`` client: each line's result equals the online endpoint's greedy answer to the
same request, bad lines get error lines, unreadable input fails the batch with ``errors``,
cancel, list pagination, file deletion, the API key, size limits, tenants, a restarted server
resuming an unfinished batch, and ``pagoda run-batch`` offline."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from server_helpers import (SERVER_ENGINE_ARGS, ServerProcess, _device_args, engine_pid, frozen, side_by_side,
                            start_server)

MODEL = "m"
KEY = "batch-test-key"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_FILE_BYTES = 16384
MAX_REQUESTS = 8
TERMINAL = {"completed", "failed", "cancelled", "expired"}


@pytest.fixture(scope="module")
def model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch-model") / "m"
    shutil.copytree(llama_dir, path)
    (path / "chat_template.jinja").write_text(CHATML)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The storage directory of the restart test's servers."""
    return tmp_path_factory.mktemp("resume-store")


def resume_flags(store: Path) -> tuple[str, ...]:
    return ("--served-model-name", MODEL, "--batch-storage-dir", str(store), "--max-concurrent-batch-requests", "1")


@pytest.fixture(scope="module")
def servers(model: Path, store: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, ServerProcess]]:
    """The main server, and the first of the restart test's two (started together: one wait)."""
    logs = tmp_path_factory.mktemp("batch-logs")
    started = {"main": ServerProcess(model, logs, "--served-model-name", MODEL, "--api-key", KEY,
                                     "--tenant-id-source", "header",
                                     "--batch-storage-dir", str(tmp_path_factory.mktemp("batch-store")),
                                     "--max-batch-file-bytes", str(MAX_FILE_BYTES),
                                     "--max-requests-per-batch", str(MAX_REQUESTS),
                                     "--max-concurrent-batch-requests", "2"),
               "resume": ServerProcess(model, logs, *resume_flags(store))}
    with side_by_side(started) as ready:
        yield ready


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id: str, content: str, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, "logprobs": True, **extra}}


def submit(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions", **kw: Any) -> Any:
    file = client.files.create(file=("in.jsonl", jsonl(lines), "application/jsonl"), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h", **kw)


def wait(client: openai.OpenAI, batch_id: str, statuses: set[str] = TERMINAL, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {r["custom_id"]: r for r in map(json.loads, text.splitlines())}


def test_lines_equal_the_online_endpoint_and_bad_lines_get_error_lines(client: openai.OpenAI) -> None:
    prompts = {"a": "Tell me a story.", "b": "Count to ten.", "c": "Why is the sky blue?"}
    lines = [chat_line(cid, text, max_tokens=4 + i) for i, (cid, text) in enumerate(prompts.items())]
    lines += [{**chat_line("wrong-url", "x"), "url": "/v1/completions"},
              {**chat_line("bad-body", "x"), "body": {"model": MODEL, "messages": 5}},
              chat_line("bad-model", "x", model="nope"),
              {**chat_line("unknown-path", "x"), "url": "/sleep"}]
    chat_batch = submit(client, lines, metadata={"job": "nightly"})
    completion_batch = submit(client, [{"custom_id": "p", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": MODEL, "prompt": "Once upon", "max_tokens": 5,
                                                 "temperature": 0}}], endpoint="/v1/completions")
    assert chat_batch.status == "validating" and chat_batch.metadata == {"job": "nightly"}
    assert chat_batch.id.startswith("batch_") and chat_batch.input_file_id.startswith("file-")
    done = wait(client, chat_batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 3, 4)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out, errors = results(client, done.output_file_id), results(client, done.error_file_id)
    assert set(out) == set(prompts) and set(errors) == {"wrong-url", "bad-body", "bad-model", "unknown-path"}
    for i, (cid, text) in enumerate(prompts.items()):
        online = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=4 + i, temperature=0, logprobs=True)
        line = out[cid]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert line["response"]["request_id"] == body["id"]
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
        assert [t["token"] for t in body["choices"][0]["logprobs"]["content"]] == \
            [t.token for t in online.choices[0].logprobs.content]
        assert body["usage"]["completion_tokens"] == online.usage.completion_tokens == 4 + i
    assert errors["wrong-url"]["response"]["status_code"] == 400
    assert errors["wrong-url"]["response"]["body"]["error"]["param"] == "url"
    assert errors["unknown-path"]["response"]["body"]["error"]["param"] == "url"
    bad_body = errors["bad-body"]["response"]
    assert bad_body["status_code"] == 400 and bad_body["body"]["error"]["param"] == "messages"
    assert errors["bad-model"]["response"]["status_code"] == 404
    completed = wait(client, completion_batch.id)
    line = results(client, completed.output_file_id)["p"]["response"]["body"]
    online = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    assert line["choices"][0]["text"] == online.choices[0].text and line["usage"]["completion_tokens"] == 5


def test_lines_interrupted_by_interactive_requests_lose_nothing(client: openai.OpenAI, server: ServerProcess) -> None:
    """Interactive requests sent while the lines run (each may give up a batch step mid-forward:
    ``EngineCore.abandon_background_when``): every line still ends with the online greedy answer,
    and so does every interactive request."""
    prompts = {str(i): f"Tell me story number {i}." for i in range(4)}
    batch = submit(client, [chat_line(cid, text, max_tokens=24) for cid, text in prompts.items()])
    wait(client, batch.id, {"in_progress", *TERMINAL})
    chats = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                            max_tokens=8, temperature=0) for i in range(4)]
    done = wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(prompts), done
    out = results(client, done.output_file_id)
    for cid, text in prompts.items():
        online = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=24, temperature=0)
        assert out[cid]["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    for i, chat in enumerate(chats):
        again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                               max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == again.choices[0].message.content
        assert chat.usage.completion_tokens == 8
    metrics = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "pagoda:background_steps_abandoned_total" in metrics


def test_unreadable_lines_fail_the_batch_with_errors(client: openai.OpenAI) -> None:
    batch = submit(client, [chat_line("a", "x"), "{not json", chat_line("a", "y"), {"method": "POST"}])
    failed = wait(client, batch.id)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    found = {(e.code, e.line) for e in failed.errors.data}
    assert found == {("invalid_json_line", 2), ("duplicate_custom_id", 3), ("missing_required_parameter", 4)}
    too_many = submit(client, [chat_line(str(i), "x", max_tokens=1) for i in range(MAX_REQUESTS + 1)])
    failed = wait(client, too_many.id)
    assert failed.status == "failed" and [e.code for e in failed.errors.data] == ["too_many_requests"]


def test_cancel_a_running_batch(client: openai.OpenAI, server: ServerProcess) -> None:
    with frozen(engine_pid(server.base_url)):  # no line can finish before the cancel
        batch = submit(client, [chat_line(str(i), "Tell me a story.", max_tokens=50) for i in range(4)])
        wait(client, batch.id, {"in_progress"})
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        cancelled = wait(client, batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    assert cancelled.request_counts.completed == 0 and results(client, cancelled.output_file_id) == {}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    # The engine is not left working for the cancelled lines, and serves the next request.
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_list_batches_pages_with_after(client: openai.OpenAI) -> None:
    made = {submit(client, [chat_line("a", "x", max_tokens=1)]).id for _ in range(3)}
    everything = [b.id for b in client.batches.list(limit=100).data]
    assert made <= set(everything) and len(everything) == len(set(everything))
    pages, after = [], None
    while True:
        page = client.batches.list(limit=2, **({"after": after} if after else {}))
        pages += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert pages == everything
    for batch_id in made:
        wait(client, batch_id)


def test_files_list_retrieve_content_delete(client: openai.OpenAI) -> None:
    data = jsonl([chat_line("a", "x")])
    file = client.files.create(file=("mine.jsonl", data, "application/jsonl"), purpose="batch")
    assert (file.bytes, file.filename, file.purpose) == (len(data), "mine.jsonl", "batch")
    assert client.files.retrieve(file.id).id == file.id
    assert client.files.content(file.id).content == data
    assert file.id in {f.id for f in client.files.list(purpose="batch").data}
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_limits_and_bad_requests_are_4xx(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1), "application/jsonl"), purpose="batch")
    assert caught.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", jsonl([chat_line("a", "x")]), "application/jsonl"),
                            purpose="fine-tune")
    file = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "x")]), "application/jsonl"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:  # no embedding model here
        client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    assert caught.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                              completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    for method, path in (("GET", "/v1/files"), ("GET", "/v1/batches"), ("GET", f"/v1/files/{file.id}/content")):
        assert httpx.request(method, server.base_url + path).status_code == 401
    anonymous = httpx.post(server.base_url + "/v1/files", files={"file": ("in.jsonl", b"{}\n")},
                           data={"purpose": "batch"})
    assert anonymous.status_code == 401


def test_files_and_batches_belong_to_their_tenant(client: openai.OpenAI, server: ServerProcess) -> None:
    alice = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0,
                          default_headers={"X-Tenant-Id": "alice"})
    batch = submit(alice, [chat_line("a", "x", max_tokens=2)])
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(batch.id)
    assert batch.id not in {b.id for b in client.batches.list(limit=100).data}
    done = wait(alice, batch.id)
    assert done.status == "completed" and results(alice, done.output_file_id)["a"]["response"]["status_code"] == 200
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)


def test_a_restarted_server_resumes_an_unfinished_batch(servers: dict[str, ServerProcess], model: Path, store: Path,
                                                       tmp_path: Path) -> None:
    first = servers["resume"]
    try:
        client = openai.OpenAI(base_url=first.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        # The first line is short and the others long, so that the server is stopped (just after
        # the first result) while the rest are still to run, however fast the machine is.
        lines = [chat_line(str(i), f"Story number {i}.", max_tokens=4 if i == 0 else 400) for i in range(4)]
        with frozen(engine_pid(first.base_url)):
            batch = submit(client, lines)
            wait(client, batch.id, {"in_progress"})
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        first.stop()
    second = start_server(model, tmp_path, *resume_flags(store))
    try:
        client = openai.OpenAI(base_url=second.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        done = wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 4, done
        out = client.files.content(done.output_file_id).text.splitlines()
        assert sorted(json.loads(line)["custom_id"] for line in out) == ["0", "1", "2", "3"]
        assert "resuming batch " + batch.id in second.log()
    finally:
        second.stop()


def test_run_batch_offline_equals_the_server(client: openai.OpenAI, model: Path, tmp_path: Path) -> None:
    lines = [chat_line("a", "Tell me a story.", max_tokens=5), {**chat_line("x", "x"), "url": "/sleep"}, "nope"]
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"),
           "-o", str(tmp_path / "out.jsonl"), "--model", str(model), "--served-model-name", MODEL,
           *SERVER_ENGINE_ARGS, *_device_args()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == ["a", "x", "line-3"]
    online = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                            max_tokens=5, temperature=0)
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert out[1]["response"]["status_code"] == 400 and out[1]["response"]["body"]["error"]["param"] == "url"
    assert out[2]["response"] is None and out[2]["error"]["code"] == "invalid_json_line"
