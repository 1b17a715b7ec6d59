"""Two models behind one ``pagoda serve`` (two real servers, started side by side): each model's
greedy output equals the offline ``LLM`` on that model, concurrently, through the official
``openai`` client; ``/v1/models`` and ``/metrics`` per model; a model's engine core killed fails
only its own in-flight request, the other keeps answering, and it loads again at its next
request; with ``--max-loaded-models 1`` a request for the other model waits while the loaded one
is busy, then the least recently used one is unloaded and the request answered. Sleep mode per
model and for all, weights updated and kept over a reload; runtime LoRA adapters on their base
model, loaded again with it; the dashboard's snapshot and page per model, and ``pagoda top``."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
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
                      f"    kv_cache_memory: 32MiB\n    enable_lora: false\n")
    started = {"both": ServerProcess(llama_dir, logs, "--served-model-name", "llama", "--model", f"qwen={qwen_dir}",
                                     "--preload", "all", "--enable-sleep-mode"),
               "one": ServerProcess(llama_dir, logs, "--served-model-name", "llama", "--models-config", str(config),
                                    "--max-loaded-models", "1", "--enable-lora", "--max-lora-rank", "16",
                                    "--allow-runtime-lora-updating")}
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


# ---- the dashboard, sleep mode and runtime adapters over several models -----------------------------

def dashboard_state(server: ServerProcess, model: str | None = None) -> httpx.Response:
    return httpx.get(server.base_url + "/dashboard/api/state", params={"model": model} if model else None,
                     timeout=30)


def top_once(server: ServerProcess, model: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda.entrypoints.top", "--url", server.base_url, "--model", model,
                           "--once"], capture_output=True, text=True, timeout=120)


def post(server: ServerProcess, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=300, **kw)


def test_dashboard_snapshot_and_top_per_model(servers):
    server = servers["both"]
    default = dashboard_state(server).json()
    assert default["server"]["model"] == "llama"  # the first loaded model
    assert [(m["name"], m["status"]) for m in default["models"]] == [("llama", "loaded"), ("qwen", "loaded")]
    before = {name: dashboard_state(server, name).json() for name in ("llama", "qwen")}
    assert before["qwen"]["server"]["model"] == "qwen" and before["qwen"]["engine"]["num_blocks"] > 0
    assert before["qwen"]["server"]["engine_pid"] == debug(server)["qwen"]["engine_pid"]
    assert before["llama"]["server"]["engine_pid"] == debug(server)["llama"]["engine_pid"]
    assert complete(server, "qwen", PROMPTS[0]).status_code == 200
    wait_until(lambda: dashboard_state(server, "qwen").json()["counters"]["finished"]
               == before["qwen"]["counters"]["finished"] + 1, "qwen's dashboard counted its request")
    assert dashboard_state(server, "llama").json()["counters"]["finished"] == before["llama"]["counters"]["finished"]
    missing = dashboard_state(server, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    out = top_once(server, "qwen")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pagoda top - qwen - cpu")
    assert "model * qwen" in out.stdout and "model   llama" in out.stdout and "HOT PREFIX" in out.stdout


def test_dashboard_page_switches_models_in_headless_chromium(servers):
    from pagoda.tools.dashboard_screenshot import DashboardBrowser, find_chromium

    if find_chromium() is None:
        pytest.skip("no Chromium executable (apt-get install chromium, or set PAGODA_CHROMIUM)")
    server = servers["both"]
    with DashboardBrowser(server.base_url) as browser:
        assert not browser.open()  # no API key: no form
        page = browser.page
        assert page.is_visible("#model-select") and page.is_visible("#models-panel")
        assert page.eval_on_selector_all("#model-select option", "os => os.map(o => o.value)") == ["llama", "qwen"]
        assert page.text_content("#model") == "llama" and page.locator("#models tbody tr").count() == 2
        page.select_option("#model-select", "qwen")
        page.wait_for_function("() => document.getElementById('model').textContent === 'qwen'", timeout=60_000)
        assert page.url.endswith("/dashboard?model=qwen")
        finished = browser.value("finished")
        assert finished == dashboard_state(server, "qwen").json()["counters"]["finished"]
        assert complete(server, "qwen", PROMPTS[1]).status_code == 200
        page.wait_for_function(f"() => Number(document.getElementById('finished').dataset.value) >= {finished + 1}",
                               timeout=60_000)
        assert page.text_content("#model") == "qwen" and browser.value("finished") == finished + 1


def test_sleep_mode_per_model_and_for_all(servers, expected, model_factory, qwen_dir):
    server = servers["both"]
    r = post(server, "/sleep", params={"model": "qwen", "level": 1})
    assert r.status_code == 200 and r.json()["model"] == "qwen" and r.json()["released_bytes"] > 0, r.text
    state = httpx.get(server.base_url + "/is_sleeping", timeout=30).json()
    assert state == {"is_sleeping": False, "models": {"llama": {"is_sleeping": False, "level": 0},
                                                      "qwen": {"is_sleeping": True, "level": 1}}}
    assert debug(server)["qwen"]["sleeping"] == 1
    waiting, result = in_background(complete, server, "qwen", PROMPTS[1])
    waiting.join(1.0)
    assert waiting.is_alive()  # qwen's request waits while qwen sleeps ...
    other = complete(server, "llama", PROMPTS[1])  # ... and llama answers meanwhile
    assert other.json()["choices"][0]["text"] == expected["llama"][1]
    woke = post(server, "/wake_up", json={"model": "qwen"})
    assert woke.status_code == 200 and woke.json() == {"is_sleeping": False, "model": "qwen"}
    waiting.join(300)
    assert result["value"].json()["choices"][0]["text"] == expected["qwen"][1]
    # Without a model: every loaded model, as one server does with its own.
    slept = post(server, "/sleep", params={"level": 2}).json()
    assert set(slept["models"]) == {"llama", "qwen"} and all(m["released_bytes"] > 0 for m in slept["models"].values())
    assert httpx.get(server.base_url + "/is_sleeping", timeout=30).json()["is_sleeping"] is True
    assert post(server, "/wake_up").json() == {"is_sleeping": False, "models": ["llama", "qwen"]}
    for name in ("llama", "qwen"):
        assert complete(server, name, PROMPTS[2]).json()["choices"][0]["text"] == expected[name][2]
    long_prompt = {"model": "llama", "prompt": list(range(5, 30)), "max_tokens": 2}
    for _ in range(2):
        assert post(server, "/v1/completions", json=long_prompt).status_code == 200
    reset = post(server, "/reset_prefix_cache", params={"model": "llama"}).json()
    assert reset["model"] == "llama" and reset["evicted_blocks"] >= 1
    assert post(server, "/reset_prefix_cache").json()["models"]["llama"] == 0
    assert post(server, "/sleep", params={"model": "nope"}).status_code == 404
    not_object = post(server, "/wake_up", json=["qwen"])  # never read as "every model"
    assert not_object.status_code == 400 and "JSON object" in not_object.json()["error"]["message"]


def test_update_weights_per_model_survives_a_reload(servers, expected, model_factory, qwen_dir):
    server = servers["both"]
    other = model_factory("qwen2", seed=11)
    r = post(server, "/update_weights", json={"model_path": str(other), "model": "qwen"})
    assert r.status_code == 200 and r.json() == {"model_path": str(other), "model": "qwen"}, r.text
    updated = complete(server, "qwen", PROMPTS[0]).json()["choices"][0]["text"]
    assert updated != expected["qwen"][0]
    assert complete(server, "llama", PROMPTS[0]).json()["choices"][0]["text"] == expected["llama"][0]
    assert post(server, "/models/unload", json={"model": "qwen"}).status_code == 200
    refused = post(server, "/sleep", params={"model": "qwen"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_not_loaded"
    assert httpx.get(server.base_url + "/is_sleeping", params={"model": "qwen"}, timeout=30).json() == {
        "model": "qwen", "is_sleeping": False, "level": 0}
    assert post(server, "/models/load", json={"model": "qwen"}).status_code == 200
    # Loaded again, it serves the checkpoint of its last update, not the one it started with.
    assert complete(server, "qwen", PROMPTS[0]).json()["choices"][0]["text"] == updated
    assert debug(server)["qwen"]["weights_path"] == str(other)
    # For all: llama (first) refuses a qwen checkpoint; nothing was updated.
    bad = post(server, "/update_weights", json={"model_path": str(qwen_dir)})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("model 'llama': ")
    assert complete(server, "qwen", PROMPTS[0]).json()["choices"][0]["text"] == updated
    back = post(server, "/update_weights", json={"model_path": str(qwen_dir), "model": "qwen"})
    assert back.status_code == 200
    assert complete(server, "qwen", PROMPTS[0]).json()["choices"][0]["text"] == expected["qwen"][0]


def test_runtime_lora_adapters_follow_their_base_model(servers, expected, lora_adapters):
    server, path = servers["one"], str(lora_adapters["attn8"])
    url = server.base_url
    loaded = post(server, "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path})
    assert loaded.status_code == 200, loaded.text  # llama, the only model with LoRA, was loaded for it
    assert statuses(server) == {"llama": "loaded", "sql": "loaded", "qwen": "loadable"}
    cards = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    assert cards["sql"]["parent"] == "llama"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    tuned = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert tuned.model == "sql" and tuned.choices[0].text != expected["llama"][0]
    # The dashboard of a model not loaded: its status, no engine; looking does not load it.
    view = dashboard_state(server, "qwen").json()
    assert view["engine"] is None and view["server"] == {**view["server"], "model": "qwen", "status": "loadable"}
    assert "not loaded" in top_once(server, "qwen").stdout and statuses(server)["qwen"] == "loadable"
    # Unloaded (as to make room), llama loads again with the adapter at the adapter's next request.
    assert post(server, "/models/unload", json={"model": "llama"}).status_code == 200
    assert statuses(server)["sql"] == "loadable"
    loads = debug(server)["llama"]["loads"]
    again = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert again.choices[0].text == tuned.choices[0].text and debug(server)["llama"]["loads"] == loads + 1
    for body, status, text in (({"lora_path": path, "base_model_name": "qwen"}, 400, "enable_lora"),
                               ({"lora_path": path, "base_model_name": "nope"}, 404, "does not exist"),
                               ({"lora_path": path, "lora_name": "sql"}, 400, "already been loaded"),
                               ({"lora_path": path, "lora_name": "qwen"}, 400, "already been loaded")):
        r = post(server, "/v1/load_lora_adapter", json={"lora_name": "x", **body})
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
    assert post(server, "/v1/unload_lora_adapter",
                json={"lora_name": "sql", "base_model_name": "qwen"}).status_code == 404
    assert post(server, "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=2)
    assert post(server, "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
    assert "sql" not in statuses(server)
