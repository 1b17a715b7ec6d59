"""LoRA through a live ``pagoda serve`` and the official ``openai`` client: adapters chosen by
``model``, listed in ``/v1/models``, loaded and unloaded while requests stream, unknown names
404, the ``pagoda:lora_requests_info`` gauge."""
from __future__ import annotations

import json
import shutil
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from lora_helpers import no_adapter_paths

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from server_helpers import ServerProcess, engine_pid, frozen, start_server  # noqa: E402

from pagoda import LoRARequest, SamplingParams  # noqa: E402
from pagoda.lora.peft import NO_ADAPTER  # noqa: E402

BASE = "base"
PROMPT = [5, 17, 42, 99, 7]
IDS = {"attn8": 1, "mlp16rs": 2, "qvdown16": 3}


@pytest.fixture(scope="module")
def server(llama_dir: Path, lora_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    modules = [f"attn8={lora_adapters['attn8']}",
               json.dumps({"name": "mlp16rs", "path": str(lora_adapters["mlp16rs"]), "base_model_name": "other"})]
    srv = start_server(llama_dir, tmp_path_factory.mktemp("lora-server-logs"), "--served-model-name", BASE,
                       "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", *modules,
                       "--allow-runtime-lora-updating")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline_text(lora_llm, adapters, name: str | None, max_tokens: int) -> str:
    req = LoRARequest(name, IDS[name], str(adapters[name])) if name else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return lora_llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=req)[0].outputs[0].text


def complete(client: openai.OpenAI, model: str, max_tokens: int = 16) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_adapters_are_listed_and_selected_by_model(client, lora_llm, lora_adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "attn8", "mlp16rs"]
    assert cards["attn8"].parent == BASE and cards["mlp16rs"].parent == "other"
    # No server path is shown: each card's root is its served name (it was the model's or adapter's path).
    assert {m.id: m.root for m in cards.values()} == {name: name for name in cards}
    card = client.models.retrieve("mlp16rs")  # one adapter's card (created is the time of the call)
    assert card.model_dump(exclude={"created"}) == cards["mlp16rs"].model_dump(exclude={"created"})
    texts = {name: complete(client, name) for name in (BASE, "attn8", "mlp16rs")}
    for name, text in texts.items():
        assert text == offline_text(lora_llm, lora_adapters, None if name == BASE else name, 16), name
    assert len(set(texts.values())) == 3  # every adapter changes the output
    chat = client.chat.completions.create(model="attn8", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "attn8"
    with pytest.raises(openai.NotFoundError, match="does not exist") as err:
        complete(client, "no-such-adapter")
    message = err.value.body["message"]
    assert not [name for name in cards if name in message], message  # served names are not listed to anyone


def test_load_and_unload_while_requests_stream(server, client, lora_llm, lora_adapters):
    url = server.base_url
    # Long enough that no stream can end between its first tokens and the pause below, however
    # the threads are scheduled (64 did end there once on a loaded two-core machine).
    max_tokens = 256
    expected = offline_text(lora_llm, lora_adapters, "attn8", max_tokens)
    pid = engine_pid(url)  # asked before the streams start: nothing but the pause after their first tokens
    started, results, after_unload = threading.Barrier(5), {}, {}
    unloaded = threading.Event()

    def stream(i: int) -> None:
        chunks = client.completions.create(model="attn8", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        text = ""
        for n, chunk in enumerate(chunks):
            text += chunk.choices[0].text if chunk.choices else ""
            if n == 0:
                started.wait(60)
            if unloaded.is_set():
                after_unload[i] = after_unload.get(i, 0) + 1
        results[i] = text

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first tokens
    responses = []

    def update() -> None:
        responses.append(httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                                    json={"lora_name": "qvdown16", "lora_path": str(lora_adapters["qvdown16"])}))
        responses.append(httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "attn8"}, timeout=60))
        unloaded.set()

    # The engine is paused while the updates are sent, so they reach it with the streams
    # still mid-way, however fast the machine; it takes them between two steps.
    with frozen(pid):
        updater = threading.Thread(target=update)
        updater.start()
        assert not unloaded.wait(0.5)  # the load waits for the paused engine
    updater.join(60)
    assert responses[0].status_code == 200 and "added successfully" in responses[0].text
    assert responses[1].status_code == 200 and "removed successfully" in responses[1].text
    # New requests for the unloaded adapter are refused while its running ones go on.
    with pytest.raises(openai.NotFoundError):
        complete(client, "attn8")
    assert complete(client, "qvdown16") == offline_text(lora_llm, lora_adapters, "qvdown16", 16)
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(4)] == [expected] * 4  # in-flight requests finished with their adapter
    assert sum(after_unload.values()) > 0  # ... and were still streaming when it was unloaded
    assert [m.id for m in client.models.list().data] == [BASE, "mlp16rs", "qvdown16"]
    # Loaded again (a new id, so no stale prefix-cache entries), it serves as before.
    resp = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "attn8", "lora_path": str(lora_adapters["attn8"])},
                      timeout=60)
    assert resp.status_code == 200
    assert complete(client, "attn8") == offline_text(lora_llm, lora_adapters, "attn8", 16)


def test_runtime_update_errors(server, lora_adapters, tmp_path):
    url = server.base_url
    cases = [
        ("/v1/load_lora_adapter", {"lora_name": "mlp16rs", "lora_path": str(lora_adapters["mlp16rs"])}, 400,
         "already been loaded"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "ghost"}, 404, "cannot be found"),
    ]
    for route, body, status, message in cases:
        resp = httpx.post(url + route, json=body, timeout=60)
        assert resp.status_code == status, (route, body, resp.text)
        assert message in resp.json()["error"]["message"]
    # Missing, a file, an empty directory, an unreadable config: one answer, telling nothing of
    # the server's files (it used to say "no such directory" or "no adapter_config.json").
    for path in no_adapter_paths(tmp_path):
        resp = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": str(path)},
                          timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"] == f"LoRA adapter {str(path)!r}: {NO_ADAPTER}"


def test_catastrophic_target_modules_regex_is_refused_while_health_answers(server, lora_adapters, tmp_path):
    """A config whose target_modules regex backtracks without end: a 400 for that load alone,
    and the server keeps answering meanwhile (the match runs off the event loop, time-limited)."""
    bad = tmp_path / "redos"
    shutil.copytree(lora_adapters["attn8"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": "(([a-z_.0-9]|[a-z])+)+[0-9]"}))
    result: dict[str, httpx.Response] = {}
    loader = threading.Thread(target=lambda: result.update(resp=httpx.post(
        server.base_url + "/v1/load_lora_adapter", json={"lora_name": "redos", "lora_path": str(bad)}, timeout=60)))
    loader.start()
    health = []
    while loader.is_alive():
        health.append(httpx.get(server.base_url + "/health", timeout=10).status_code)
    loader.join()
    assert health and set(health) == {200}
    assert result["resp"].status_code == 400, result["resp"].text
    assert "took longer than" in result["resp"].json()["error"]["message"]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_lora_requests_info_metric(server, client):
    complete(client, "mlp16rs", 4)
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("pagoda:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]
    assert 'running_lora_adapters=""' in lines[0] and 'waiting_lora_adapters=""' in lines[0]  # all done
