"""Two models behind one ``pagoda serve`` (two real servers, started side by side): each model's
greedy output equals the offline ``LLM`` on that model, concurrently, through the official
``openai`` client; ``/v1/models`` and ``/metrics`` per model; a model's engine core killed fails
only its own in-flight request, the other keeps answering, and it loads again at its next
request; with ``--max-loaded-models 1`` a request for the other model waits while the loaded one
is busy, then the least recently used one is unloaded and the request answered."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from server_helpers import ServerProcess, frozen, side_by_side

PROMPTS = ["Hello, my name is", "The capital of France", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen_dir(model_factory) -> Path:
    return model_factory("qwen2")


@pytest.fixture(scope="module")
def servers(llama_dir: Path, qwen_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """"both": the two models preloaded (the positional model and --model); "one": the positional
    model and a models file's, at most one loaded, none at start."""
    logs = tmp_path_factory.mktemp("models-server-logs")
    config = logs / "models.yaml"
    config.write_text(f"models:\n  - name: qwen\n    model: {qwen_dir}\n    max-model-len: 256\n"
                      f"    kv_cache_memory: 32MiB\n")
    started = {"both": ServerProcess(llama_dir, logs, "--served-model-name", "llama", "--model", f"qwen={qwen_dir}",
                                     "--preload", "all"),
               "one": ServerProcess(llama_dir, logs, "--served-model-name", "llama", "--models-config", str(config),
                                    "--max-loaded-models", "1")}
    with side_by_side(started) as ready:
        yield ready


@pytest.fixture(scope="module")
def expected(llama_llm: LLM, qwen_dir: Path) -> dict[str, list[str]]:
    """Each model's greedy completions of ``PROMPTS``, offline."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    texts = {"llama": [o.outputs[0].text for o in llama_llm.generate(PROMPTS, params, use_tqdm=False)]}
    qwen = LLM(str(qwen_dir), kv_cache_memory=32 << 20, max_model_len=512)
    try:
        texts["qwen"] = [o.outputs[0].text for o in qwen.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        qwen.shutdown()
    return texts


def debug(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.base_url + "/debug/models", timeout=30).json()["models"]


def statuses(server: ServerProcess) -> dict[str, str]:
    data = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    return {card["id"]: card["status"] for card in data}


def complete(server: ServerProcess, model: str, prompt: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=300,
                      json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def in_background(fn, *args) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args)))
    thread.start()
    return thread, result


def test_each_model_answers_its_own_greedy_output_concurrently(servers, expected):
    server = servers["both"]
    assert statuses(server) == {"llama": "loaded", "qwen": "loaded"}
    card = httpx.get(server.base_url + "/v1/models/qwen", timeout=30).json()
    assert card["id"] == "qwen" and card["status"] == "loaded" and card["max_model_len"] == 512
    assert httpx.get(server.base_url + "/v1/models/nope", timeout=30).status_code == 404

    async def run() -> dict[str, list[str]]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        calls = {name: [client.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                        for p in PROMPTS] for name in ("llama", "qwen")}
        flat = await asyncio.gather(*calls["llama"], *calls["qwen"])
        await client.close()
        assert {out.model for out in flat} == {"llama", "qwen"}
        return {"llama": [o.choices[0].text for o in flat[:len(PROMPTS)]],
                "qwen": [o.choices[0].text for o in flat[len(PROMPTS):]]}

    assert asyncio.run(run()) == expected
    assert expected["llama"] != expected["qwen"]  # two different models, not one answering for both


def test_chat_tokenize_and_errors_route_by_model(servers, llama_dir, qwen_dir):
    server = servers["both"]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chat = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "qwen" and chat.usage.completion_tokens >= 1
    from pagoda.tokenizer import load_tokenizer

    for name, path in (("llama", llama_dir), ("qwen", qwen_dir)):
        tokens = httpx.post(server.base_url + "/tokenize", json={"model": name, "prompt": PROMPTS[0]}).json()["tokens"]
        assert tokens == load_tokenizer(str(path)).encode(PROMPTS[0])
    with pytest.raises(openai.NotFoundError, match="'llama', 'qwen'"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    missing = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    anthropic = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
        "model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
    message = httpx.post(server.base_url + "/v1/messages", timeout=300, json={
        "model": "llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200 and message.json()["model"] == "llama"
    created = client.responses.create(model="qwen", input="hi", max_output_tokens=3)
    assert created.model == "qwen" and client.responses.retrieve(created.id).id == created.id  # one shared store
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for name in ("llama", "qwen"):
        assert f'pagoda:request_success_total{{finished_reason="length",model_name="{name}"}}' in text
    assert text.count("# TYPE pagoda:request_success_total counter") == 1  # one family, a series per model
    assert 'pagoda:model_loaded{model_name="qwen"} 1.0' in text


def test_batch_lines_route_by_their_model(servers, expected):
    server = servers["both"]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    lines = [{"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": name, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0}}
             for name in ("llama", "qwen", "nope") for i in range(2)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("in.jsonl", data, "application/jsonl"), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status in {"completed", "failed", "expired"},
               "the batch finished", timeout=300)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 4 and done.request_counts.failed == 2
    rows = {r["custom_id"]: r for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    for name in ("llama", "qwen"):
        for i in range(2):
            body = rows[f"{name}-{i}"]["response"]["body"]
            assert body["model"] == name and body["choices"][0]["text"] == expected[name][i]
    errors = {r["custom_id"]: r for r in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert {errors[f"nope-{i}"]["response"]["status_code"] for i in range(2)} == {404}


def test_a_killed_model_fails_only_its_own_requests_and_loads_again(servers, expected):
    server = servers["both"]
    pid = debug(server)["qwen"]["engine_pid"]
    os.kill(pid, signal.SIGSTOP)  # paused: its request stays in flight for as long as the test needs
    try:
        thread, result = in_background(complete, server, "qwen", PROMPTS[0])
        wait_until(lambda: debug(server)["qwen"]["in_flight"] == 1, "the qwen request in flight")
        other = complete(server, "llama", PROMPTS[1])  # the other model answers meanwhile
        assert other.status_code == 200 and other.json()["choices"][0]["text"] == expected["llama"][1]
    finally:
        os.kill(pid, signal.SIGKILL)
    thread.join(300)
    failed = result["value"]
    assert failed.status_code == 503, failed.text
    assert "'qwen'" in failed.json()["error"]["message"]
    wait_until(lambda: statuses(server)["qwen"] == "loadable", "qwen marked loadable")
    assert statuses(server)["llama"] == "loaded"
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    again = complete(server, "qwen", PROMPTS[2])  # loads it again
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected["qwen"][2]
    state = debug(server)["qwen"]
    assert state["loads"] == 2 and state["engine_pid"] != pid and "exited" in state["last_error"]


def test_one_loaded_model_at_a_time_unloads_the_idle_one(servers, expected):
    server = servers["one"]
    assert statuses(server) == {"llama": "loadable", "qwen": "loadable"}
    card = httpx.get(server.base_url + "/v1/models/qwen", timeout=30).json()
    assert card["max_model_len"] == 256  # its own option from the models file; llama keeps the command line's
    assert httpx.get(server.base_url + "/v1/models/llama", timeout=30).json()["max_model_len"] == 512
    first = complete(server, "llama", PROMPTS[0])  # waits for the load, then answers
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == expected["llama"][0]
    assert statuses(server) == {"llama": "loaded", "qwen": "loadable"}
    pid = debug(server)["llama"]["engine_pid"]
    with frozen(pid):
        busy, busy_result = in_background(complete, server, "llama", PROMPTS[1])
        wait_until(lambda: debug(server)["llama"]["in_flight"] == 1, "the llama request in flight")
        waiting, waiting_result = in_background(complete, server, "qwen", PROMPTS[1])
        wait_until(lambda: debug(server)["qwen"]["status"] == "loading", "qwen loading")
        state = debug(server)
        # llama has a request in flight: it stays loaded, and qwen's request waits for room.
        assert state["llama"]["status"] == "loaded" and state["llama"]["engine_pid"] == pid
        assert waiting.is_alive()
    busy.join(300)
    waiting.join(300)
    assert busy_result["value"].json()["choices"][0]["text"] == expected["llama"][1]
    assert waiting_result["value"].json()["choices"][0]["text"] == expected["qwen"][1]
    assert statuses(server) == {"llama": "loadable", "qwen": "loaded"}
    back = complete(server, "llama", PROMPTS[3])
    assert back.status_code == 200 and back.json()["choices"][0]["text"] == expected["llama"][3]
    state = debug(server)
    assert state["llama"]["loads"] == 2 and state["qwen"]["loads"] == 1 and state["qwen"]["status"] == "loadable"
    # An operator's unload and load (llama.cpp's router routes).
    unloaded = httpx.post(server.base_url + "/models/unload", json={"model": "llama"}, timeout=60)
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "loadable"
    assert statuses(server) == {"llama": "loadable", "qwen": "loadable"}
    assert httpx.post(server.base_url + "/models/unload", json={"model": "nope"}, timeout=60).status_code == 404
    loaded = httpx.post(server.base_url + "/models/load", json={"model": "qwen"}, timeout=300)
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
    assert debug(server)["qwen"]["loads"] == 2
