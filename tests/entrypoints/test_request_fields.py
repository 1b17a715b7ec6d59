"""The request-field policy and the small endpoints, through the official ``openai`` client
against live servers: OpenAI's and vLLM's fields are accepted (those without effect change
nothing), unknown fields are ignored with a warning (a 400 on a ``--strict-request-fields``
server), continuous usage in streams, the chat template's inputs (``chat_template_kwargs``,
``reasoning_effort``, ``documents``, ``tools`` on /tokenize, ``continue_final_message``, chat
``echo``), vLLM's ``guided_*`` names, ``models.retrieve``, ``/ping`` and the 404 of an endpoint
pagoda does not serve."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from server_helpers import ServerProcess, side_by_side

MODEL = "tiny"
USER = [{"role": "user", "content": "Hello there"}]
WARNING = "ignored request fields pagoda does not know"
# The test checkpoint's chat template, plus the variables a Qwen3-style template reads: tools,
# documents, enable_thinking (False writes an empty think block) and reasoning_effort.
TEMPLATE = (
    "{%- if documents %}{{ '<|im_start|>system\\nDocuments:' }}{% for d in documents %}"
    "{{ ' ' + d['title'] + '=' + d['text'] }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- if reasoning_effort is defined %}{{ 'effort=' + reasoning_effort + '\\n' }}{% endif %}"
    "{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("fields-model") / "llama"
    shutil.copytree(llama_dir, target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    return target


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("fields-logs")
    started = {"default": ServerProcess(model_dir, logs, "--served-model-name", MODEL),
               "strict": ServerProcess(model_dir, logs, "--served-model-name", MODEL, "--strict-request-fields")}
    with side_by_side(started) as ready:
        yield ready


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["default"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def prompt_text(server: ServerProcess, **body: Any) -> tuple[list[int], str]:
    """The token ids /tokenize gives for chat ``body``, and their text."""
    resp = post(server, "/tokenize", {"messages": USER, **body})
    assert resp.status_code == 200, resp.text
    ids = resp.json()["tokens"]
    return ids, post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


def greedy_chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, **{"messages": USER, "max_tokens": 6, "temperature": 0,
                                                           "extra_body": {"ignore_eos": True}, **kw})


# ---- the field policy --------------------------------------------------------------------------

# OpenAI's fields with no effect on a self-hosted server, and vLLM's hints for its own engine.
NO_EFFECT_CHAT = {
    "metadata": {"team": "a"}, "store": True, "service_tier": "auto", "user": "u-1", "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"}, "safety_identifier": "s", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "verbosity": "low", "web_search_options": {}, "audio": None,
    "request_id": "r-1", "guided_decoding_backend": "xgrammar", "mm_processor_kwargs": {}, "priority": 0,
    "use_beam_search": False, "length_penalty": 1.0, "return_token_ids": False, "vllm_xargs": {"a": 1},
    "spaces_between_special_tokens": True, "repetition_min_count": 0,
}


def test_fields_without_effect_change_nothing_and_warn_nothing(server: ServerProcess,
                                                               client: openai.OpenAI) -> None:
    plain = greedy_chat(client)
    extra = {k: v for k, v in NO_EFFECT_CHAT.items() if k not in ("metadata", "store", "service_tier", "user",
                                                                     "modalities", "prediction", "audio")}
    dressed = greedy_chat(client, metadata={"team": "a"}, store=True, service_tier="auto", user="u-1",
                          modalities=["text"], prediction={"type": "content", "content": "x"},
                          stream_options=None, extra_body={"ignore_eos": True, **extra})
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    stream = greedy_chat(client, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].message.content
    cmpl = dict(model=MODEL, prompt="Once", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(**cmpl)
    out2 = client.completions.create(**{**cmpl, "user": "u", "extra_body": {
        "ignore_eos": True, "add_special_tokens": True, "priority": 0, "request_id": "x", "metadata": {}}})
    assert out2.choices[0].text == out.choices[0].text
    assert WARNING not in server.log()  # every one of them is a known field


def test_unknown_fields_are_ignored_with_one_warning_naming_them(server: ServerProcess,
                                                                 client: openai.OpenAI) -> None:
    plain = greedy_chat(client)
    odd = greedy_chat(client, messages=[{**USER[0], "mystery_part": 1}],
                      extra_body={"ignore_eos": True, "frobnicate_chat": {"x": 1}})
    assert odd.choices[0].message.content == plain.choices[0].message.content
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"frobnicate_cmpl": 1})
    assert list(out)[-1].usage is not None
    assert post(server, "/tokenize", {"prompt": "x", "frobnicate_tok": 1}).status_code == 200
    log = server.log()
    lines = [line for line in log.splitlines() if WARNING in line]
    assert any("'frobnicate_chat'" in line and "'messages[0].mystery_part'" in line for line in lines), lines
    assert sum("frobnicate_chat" in line for line in lines) == 1  # one warning per request
    assert any("'frobnicate_cmpl'" in line for line in lines) and any("'frobnicate_tok'" in line for line in lines)


def test_a_flood_of_unknown_fields_is_named_in_one_bounded_line(server: ServerProcess) -> None:
    body = {"messages": USER, "max_tokens": 1, **{f"flood_{i}": i for i in range(500)}}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    line = next(line for line in server.log().splitlines() if "flood_0" in line)
    assert "and 490 more" in line and len(line) < 1000


STRICT_REFUSED = [
    ("/v1/chat/completions", {"messages": USER, "frobnicate": 1}, "frobnicate", "frobnicate"),
    ("/v1/chat/completions", {"messages": [{**USER[0], "audio": {"id": "1"}}]}, "messages", "messages[0].audio"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options", "stream_options.x"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate", "frobnicate"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate", "frobnicate"),
    ("/detokenize", {"tokens": [5], "frobnicate": 1}, "frobnicate", "frobnicate"),
]


@pytest.mark.parametrize("path,body,param,needle", STRICT_REFUSED, ids=[f"{c[0]} {c[3]}" for c in STRICT_REFUSED])
def test_strict_server_refuses_unknown_fields(servers: dict[str, ServerProcess], path: str, body: dict,
                                              param: str, needle: str) -> None:
    strict = servers["strict"]
    resp = post(strict, path, {"max_tokens": 1, **body} if "v1" in path else body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and needle in error["message"] and error["type"] == "invalid_request_error"
    assert post(servers["default"], path, {"max_tokens": 1, **body} if "v1" in path else body).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "x", "max_output_tokens": 1, "frobnicate": 1}),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1})])
def test_strict_server_covers_the_responses_and_messages_apis(servers: dict[str, ServerProcess], path: str,
                                                              body: dict) -> None:
    """The other APIs share the field policy: the strict server's 400 names the field, the
    default server serves the request (and logs the field)."""
    resp = post(servers["strict"], path, {"model": MODEL, **body})
    assert resp.status_code == 400 and "frobnicate" in resp.text, resp.text
    assert post(servers["default"], path, {"model": MODEL, **body}).status_code == 200


def test_strict_server_accepts_every_known_field(servers: dict[str, ServerProcess]) -> None:
    strict = servers["strict"]
    body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "low", "documents": [{"title": "t", "text": "x"}], "echo": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **NO_EFFECT_CHAT}
    resp = post(strict, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    doc = httpx.get(strict.base_url + "/openapi.json").json()["components"]["schemas"]
    assert doc["ChatCompletionRequest"]["additionalProperties"] is False
    assert doc["StreamOptions"]["additionalProperties"] is False


# ---- streams with usage in every chunk -----------------------------------------------------------

def _check_running_usage(chunks: list[Any], max_tokens: int) -> None:
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    prompt = usages[0].prompt_tokens
    assert prompt > 0 and all(u.prompt_tokens == prompt for u in usages)
    done = [u.completion_tokens for u in usages]
    assert done == sorted(done) and done[-1] == max_tokens
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


def test_continuous_usage_stats_in_every_chunk(server: ServerProcess, client: openai.OpenAI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(greedy_chat(client, max_tokens=8, stream=True, stream_options=options))
    whole = greedy_chat(client, max_tokens=8)
    # Tokens may arrive several to a chunk (multi-step decode rounds): at least one content chunk
    # and the final usage chunk, each carrying the running usage.
    assert len(chat) >= 2
    _check_running_usage(chat, 8)
    assert chat[-1].choices == [] and chat[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == whole.choices[0].message.content
    cmpl = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0, stream=True,
                                          stream_options=options, extra_body={"ignore_eos": True}))
    _check_running_usage(cmpl, 8)
    assert cmpl[-1].usage.prompt_tokens == post(server, "/tokenize", {"prompt": "Once upon"}).json()["count"]
    # Without continuous_usage_stats only the last chunk carries usage (OpenAI's include_usage).
    plain = list(greedy_chat(client, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain].count(True) == 1 and plain[-1].usage is not None


def test_guidellm_shaped_stream(server: ServerProcess) -> None:
    """The body guidellm 0.8 streams by default (``pagoda bench guidellm`` runs guidellm itself)."""
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 5, "stop": None, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert all(e["usage"] is not None for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 5


# ---- the chat template's inputs ------------------------------------------------------------------

def test_chat_template_kwargs_reasoning_effort_and_documents_reach_the_template(server: ServerProcess,
                                                                                client: openai.OpenAI) -> None:
    base_ids, base = prompt_text(server)
    off_ids, off = prompt_text(server, chat_template_kwargs={"enable_thinking": False})
    assert "<think>" not in base and off == base + "<think>\n\n</think>\n\n"
    _, effort = prompt_text(server, reasoning_effort="high")
    assert effort == base + "effort=high\n"
    # chat_template_kwargs win over reasoning_effort.
    _, both = prompt_text(server, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert both.endswith("effort=low\n")
    _, docs = prompt_text(server, documents=[{"title": "T", "text": "alpha"}])
    assert docs.startswith("<|im_start|>system\nDocuments: T=alpha<|im_end|>\n") and docs.endswith(base)
    # The chat route renders the same prompt (its usage counts it).
    thinking_off = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    reply = greedy_chat(client, reasoning_effort="high", extra_body=thinking_off)
    ids, expected = prompt_text(server, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert reply.usage.prompt_tokens == len(ids) and expected.endswith("</think>\n\neffort=high\n")
    assert greedy_chat(client).usage.prompt_tokens == len(base_ids) and len(off_ids) > len(base_ids)


def test_tokenize_with_tools_renders_them_as_chat_does(server: ServerProcess, client: openai.OpenAI) -> None:
    ids, text = prompt_text(server, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nTools: get_weather<|im_end|>\n")
    reply = greedy_chat(client, tools=TOOLS, tool_choice="none")
    assert reply.usage.prompt_tokens == len(ids)
    bad = post(server, "/tokenize", {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_continue_final_message_and_chat_echo(server: ServerProcess, client: openai.OpenAI) -> None:
    start = "The answer is"
    messages = [*USER, {"role": "assistant", "content": start}]
    ids, text = prompt_text(server, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n" + start)  # the final message is left open
    kw = dict(messages=messages, max_tokens=6, extra_body={"ignore_eos": True, "add_generation_prompt": False,
                                                           "continue_final_message": True})
    reply = greedy_chat(client, **kw)
    # The continuation is the plain completion of the same prompt tokens.
    cmpl = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == cmpl.choices[0].text
    echoed = greedy_chat(client, **{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == start + cmpl.choices[0].text
    stream = greedy_chat(client, stream=True, **{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == start + cmpl.choices[0].text
    # With a generation prompt the reply answers the user's message: nothing of it is echoed.
    fresh = greedy_chat(client)
    assert greedy_chat(client, extra_body={"ignore_eos": True, "echo": True}).choices[0].message.content \
        == fresh.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        greedy_chat(client, messages=messages, extra_body={"continue_final_message": True})
    assert err.value.body["param"] == "continue_final_message"
    resp = post(server, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_may_not_set_the_templates_own_arguments(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        greedy_chat(client, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert err.value.body["param"] == "chat_template_kwargs" and "add_generation_prompt" in err.value.body["message"]
    # A variable of a type the template cannot use, or a document the template cannot read: a 400.
    with pytest.raises(openai.BadRequestError) as err:
        greedy_chat(client, extra_body={"chat_template_kwargs": {"reasoning_effort": 5}})
    assert err.value.body["param"] == "chat_template_kwargs" and "chat template" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        greedy_chat(client, extra_body={"documents": [{"text": "no title"}]})
    assert err.value.body["param"] == "messages" and "chat template" in err.value.body["message"]
    assert greedy_chat(client).choices[0].finish_reason == "length"  # still serving


# ---- vLLM's guided_* names -----------------------------------------------------------------------

def test_guided_aliases_constrain_the_output(client: openai.OpenAI) -> None:
    choices = ["yes", "no", "maybe"]
    for seed in range(3):
        out = greedy_chat(client, temperature=1.0, seed=seed, max_tokens=10,
                          extra_body={"guided_choice": choices})
        assert out.choices[0].message.content in choices
    cmpl = client.completions.create(model=MODEL, prompt="Number:", max_tokens=10, temperature=1.0, seed=1,
                                     extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", cmpl.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    data = greedy_chat(client, max_tokens=40, extra_body={"guided_json": schema}).choices[0].message.content
    assert set(json.loads(data)) == {"ok"} and isinstance(json.loads(data)["ok"], bool)


@pytest.mark.parametrize("extra,param", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
])
def test_guided_aliases_are_validated(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        greedy_chat(client, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


# ---- small endpoints -----------------------------------------------------------------------------

def test_models_retrieve(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump()["max_model_len"] == client.models.list().data[0].model_dump()["max_model_len"]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/not-served")
    assert err.value.body["code"] == "model_not_found" and "org/not-served" in err.value.body["message"]


def test_ping_answers_get_and_post_like_health(server: ServerProcess) -> None:
    health = httpx.get(server.base_url + "/health").json()
    for method in ("GET", "POST"):
        resp = httpx.request(method, server.base_url + "/ping")
        assert resp.status_code == 200 and resp.json() == health


@pytest.mark.parametrize("method,path", [("POST", "/v1/embeddings"), ("POST", "/v1/images/generations"),
                                         ("POST", "/v1/audio/speech"), ("GET", "/v1/fine_tuning/jobs")])
def test_unserved_endpoint_says_so(server: ServerProcess, method: str, path: str) -> None:
    resp = httpx.request(method, server.base_url + path, json={"model": MODEL, "input": "x"})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "endpoint_not_served"
    assert error["message"].startswith(f"pagoda does not serve {method} {path};")
    assert "/v1/chat/completions" in error["message"]


def test_openai_client_sees_the_unserved_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model=MODEL, input="x")
    assert "pagoda does not serve POST /v1/embeddings" in str(err.value)
