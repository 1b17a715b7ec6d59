"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the official
``anthropic`` client, on two real servers started side by side: the random llama checkpoint with
``--api-key`` (greedy text, stop sequences, max_tokens, forced tool calls, tool results, token
counts, errors, both key headers) and the scripted thinking checkpoint with
``--reasoning-parser`` (thinking blocks, whole and streamed)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import jsonschema
import pytest

from server_helpers import ServerProcess, side_by_side

MODEL = "tiny"
THINK = "m"  # the model name of the session's thinking server (think_server, tests/entrypoints/conftest.py)
KEY = "sekrit"
USER = [{"role": "user", "content": "Tell me about the sea."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "weather", "description": "The weather in a city", "input_schema": SCHEMA}


# The scripted agent's reply: thinking, then a call in the hermes format (the call's JSON is one
# token of its tokenizer, as each token of a scripted chain may appear only once).
AGENT_REASONING = "Checking"
AGENT_CALL = '{"name": "verdict", "arguments": {"ok": true}}'
AGENT_PIECES = ["<think>", AGENT_REASONING, "</think>", "<tool_call>", AGENT_CALL, "</tool_call>"]


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagoda.tools.scripted_model import THINK_TOKENS, make_scripted_model

    return make_scripted_model(tmp_path_factory.mktemp("agent"), AGENT_PIECES,
                               added_tokens=(*THINK_TOKENS, "<tool_call>", "</tool_call>", AGENT_CALL))


@pytest.fixture(scope="module")
def servers(llama_dir: Path, think_server: ServerProcess, agent_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """plain and agent: this module's own servers; think: the session's thinking server (served
    as ``THINK``)."""
    logs = tmp_path_factory.mktemp("anthropic-logs")
    started = {"plain": ServerProcess(llama_dir, logs, "--served-model-name", MODEL, "--api-key", KEY),
               "agent": ServerProcess(agent_model, logs, "--served-model-name", MODEL, "--reasoning-parser",
                                      "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")}
    with side_by_side(started, shared=(think_server,)) as ready:
        yield {**ready, "think": think_server}


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["plain"]


def make_client(server: ServerProcess, **auth: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=120, **(auth or {"api_key": KEY}))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return make_client(server)


def greedy(kw: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments, greedy (the SDK no longer has a temperature argument: the body
    field is sent as an extra)."""
    extra = {"temperature": 0, **kw.pop("extra_body", {})}
    return {"model": MODEL, "max_tokens": 24, "messages": USER, **kw, "extra_body": extra}


def create(client: anthropic.Anthropic, **kw: Any) -> Any:
    return client.messages.create(**greedy(kw))


def streamed(client: anthropic.Anthropic, **kw: Any) -> tuple[str, Any, list[Any]]:
    """(the text deltas joined, the final message, the events) of a streamed reply."""
    with client.messages.stream(**greedy(kw)) as stream:
        events = list(stream)
        message = stream.get_final_message()
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    return text, message, events


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_reply_whole_and_streamed(client: anthropic.Anthropic) -> None:
    message = create(client)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and text_of(message)
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    text, final, _ = streamed(client)
    assert text == text_of(message)
    assert final.content[0].text == text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    assert (final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
            == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0))


def test_event_order_and_shapes(server: ServerProcess) -> None:
    """The raw stream: ``event:`` lines naming each data's type, in Anthropic's order."""
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = []
    for chunk in raw.strip().split("\n\n"):
        name_line, data_line = chunk.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append(data)
    names = [e["type"] for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 8


def test_system_prompt_reaches_the_model(client: anthropic.Anthropic) -> None:
    plain = create(client)
    as_text = create(client, system="You are a fish.")
    as_blocks = create(client, system=[{"type": "text", "text": "You are a fish."}])
    assert text_of(as_text) == text_of(as_blocks)
    assert as_text.usage.input_tokens + (as_text.usage.cache_read_input_tokens or 0) > \
        plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(client: anthropic.Anthropic, stream: bool) -> None:
    full = text_of(create(client, max_tokens=32))
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3) if full[i:i + 3].strip())
    expected = full[:full.find(stop)]
    if stream:
        text, message, _ = streamed(client, max_tokens=32, stop_sequences=[stop])
        assert text == expected
    else:
        message = create(client, max_tokens=32, stop_sequences=[stop])
    assert text_of(message) == expected
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_max_tokens(client: anthropic.Anthropic) -> None:
    message = create(client, max_tokens=5)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use(client: anthropic.Anthropic, stream: bool) -> None:
    kw = dict(max_tokens=64, tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"})
    if stream:
        _, message, events = streamed(client, **kw)
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert deltas and all(d.type == "input_json_delta" for d in deltas)
        assert json.loads("".join(d.partial_json for d in deltas)) == message.content[0].input
    else:
        message = create(client, **kw)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, SCHEMA)
    assert message.stop_reason == "tool_use"


def test_any_tool_choice_calls_a_tool(client: anthropic.Anthropic) -> None:
    message = create(client, max_tokens=96, tools=[WEATHER], tool_choice={"type": "any",
                                                                          "disable_parallel_tool_use": True})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "weather"
    jsonschema.validate(uses[0].input, SCHEMA)
    assert message.stop_reason == "tool_use"


def without_ids(message: Any) -> list[dict]:
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]


@pytest.mark.parametrize("choice,max_tokens", [({"type": "tool", "name": "weather"}, 10), ({"type": "any"}, 30)],
                         ids=["tool", "any"])
def test_forced_tool_use_cut_short_has_one_shape(client: anthropic.Anthropic, choice: dict, max_tokens: int) -> None:
    """Cut off by max_tokens, a forced call is the same partial tool_use block streamed or not."""
    kw = dict(max_tokens=max_tokens, tools=[WEATHER], tool_choice=choice)
    message = create(client, **kw)
    _, final, _ = streamed(client, **kw)
    assert message.stop_reason == final.stop_reason == "max_tokens"
    assert without_ids(message) == without_ids(final)
    # (These budgets end inside the arguments: after the name, before the object closes.)
    assert [(b.type, b.name) for b in message.content] == [("tool_use", "weather")]
    assert set(message.content[0].input) < set(SCHEMA["properties"])


@pytest.mark.parametrize("stream", [False, True])
def test_output_config_format_is_structured_output(client: anthropic.Anthropic, stream: bool) -> None:
    kw = dict(max_tokens=64, output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    message = streamed(client, **kw)[1] if stream else create(client, **kw)
    jsonschema.validate(json.loads(text_of(message)), SCHEMA)
    assert message.stop_reason == "end_turn"


TOOL_TURNS = [*USER,
              {"role": "assistant", "content": [
                  {"type": "text", "text": "Let me look."},
                  {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo", "unit": "c"}}]},
              {"role": "user", "content": [
                  {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Cold and wet.", "is_error": False},
                  {"type": "text", "text": "And tomorrow?"}]}]
# The same conversation as chat messages.
CHAT_TURNS = [*USER,
              {"role": "assistant", "content": "Let me look.", "tool_calls": [
                  {"id": "toolu_1", "type": "function",
                   "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}}]},
              {"role": "tool", "tool_call_id": "toolu_1", "content": "Cold and wet."},
              {"role": "user", "content": "And tomorrow?"}]


def test_tool_result_turn(server: ServerProcess, client: anthropic.Anthropic) -> None:
    message = create(client, messages=TOOL_TURNS, tools=[WEATHER], tool_choice={"type": "none"})
    assert message.stop_reason in ("end_turn", "max_tokens") and text_of(message)
    count = client.messages.count_tokens(model=MODEL, messages=TOOL_TURNS)
    chat = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "messages": CHAT_TURNS},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert chat.status_code == 200, chat.text
    assert count.input_tokens == chat.json()["count"]
    # Blocks as content of the tool result render the same as a string.
    blocks = json.loads(json.dumps(TOOL_TURNS))
    blocks[2]["content"][0]["content"] = [{"type": "text", "text": "Cold and wet."}]
    assert client.messages.count_tokens(model=MODEL, messages=blocks).input_tokens == count.input_tokens


def test_count_tokens_equals_the_prompt_the_reply_reports(client: anthropic.Anthropic) -> None:
    kw = dict(system="Be brief.", messages=TOOL_TURNS, tools=[WEATHER])
    count = client.messages.count_tokens(model=MODEL, **kw)
    message = create(client, max_tokens=4, tool_choice={"type": "none"}, **kw)
    assert count.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert count.input_tokens > client.messages.count_tokens(model=MODEL, messages=USER).input_tokens


def test_cached_prompt_tokens_are_reported(client: anthropic.Anthropic) -> None:
    long_user = [{"role": "user", "content": "The sea is wide and deep. " * 30}]
    first = create(client, messages=long_user, max_tokens=2)
    second = create(client, messages=long_user, max_tokens=2)
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total


# A 1x1 PNG, as Anthropic's clients send images (base64 with its media type).
PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="


def test_image_blocks_parse_and_a_text_only_model_refuses_them(client: anthropic.Anthropic) -> None:
    """Image blocks (base64 and URL sources) are accepted by the request model and reach the
    model check: this text-only model answers Anthropic's 400 saying so."""
    for source in ({"type": "base64", "media_type": "image/png", "data": PNG_1X1},
                   {"type": "url", "url": "https://example.com/cat.png"}):
        with pytest.raises(anthropic.BadRequestError) as err:
            create(client, messages=[{"role": "user", "content": [
                {"type": "image", "source": source}, {"type": "text", "text": "What is this?"}]}])
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert "takes text only" in err.value.body["error"]["message"], err.value.body
    assert create(client, max_tokens=2).usage.output_tokens == 2  # and it keeps serving


def test_invalid_requests_are_anthropic_400s(client: anthropic.Anthropic, server: ServerProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, max_tokens="5")  # the SDK sends what it is given
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    for bad in ({"extra_body": {"temperature": True}}, {"messages": [{"role": "user", "content": [image]}]},
                {"messages": []}, {"tool_choice": {"type": "tool", "name": "absent"}, "tools": [WEATHER]}):
        with pytest.raises(anthropic.BadRequestError) as err:
            create(client, **bad)
        assert err.value.body["error"]["type"] == "invalid_request_error", bad
    missing = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, "messages": USER},
                         headers={"x-api-key": KEY}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as err:
        create(client, model="claude-opus")
    assert err.value.body["error"]["type"] == "not_found_error"
    # Unknown fields are ignored (with a warning in the log), and the server keeps serving.
    assert create(client, max_tokens=3, extra_body={"container": "x", "mcp_servers": []}).usage.output_tokens == 3
    assert "ignored request fields pagoda does not know: 'container', 'mcp_servers'" in server.log()


@pytest.mark.parametrize("auth", [{"api_key": "wrong"}, {"auth_token": "wrong"}], ids=["x-api-key", "bearer"])
def test_wrong_key_is_an_authentication_error(server: ServerProcess, auth: dict) -> None:
    with pytest.raises(anthropic.AuthenticationError) as err:
        create(make_client(server, **auth))
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": err.value.body["error"]["message"]}}
    good = {k: KEY for k in auth}
    assert create(make_client(server, **good), max_tokens=2).usage.output_tokens == 2
    # The OpenAI routes take the key either way too, and keep OpenAI's error shape.
    wrong = httpx.get(server.base_url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=30).status_code == 200


# ---- thinking blocks (--reasoning-parser) ------------------------------------------------------

@pytest.fixture(scope="module")
def think_client(servers: dict[str, ServerProcess]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=servers["think"].base_url, api_key="unused", max_retries=0, timeout=120)


def test_thinking_block_whole_and_streamed(think_client: anthropic.Anthropic, think_model) -> None:
    message = create(think_client, model=THINK, max_tokens=40, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == think_model.reasoning
    assert message.content[1].text == think_model.answer
    assert message.stop_reason == "end_turn"
    _, final, events = streamed(think_client, model=THINK, max_tokens=40)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in kinds and kinds == sorted(kinds, key=lambda k: k != "thinking_delta")
    assert not any("think>" in json.dumps(e.model_dump()) for e in events)


def test_cut_off_while_thinking(think_client: anthropic.Anthropic, think_model) -> None:
    message = create(think_client, model=THINK, max_tokens=3)
    assert [b.type for b in message.content] == ["thinking"] and message.stop_reason == "max_tokens"
    assert think_model.reasoning.startswith(message.content[0].thinking)


def test_thinking_then_forced_tool_use(think_client: anthropic.Anthropic, think_model) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    kw = dict(max_tokens=40, tools=[{"name": "verdict", "input_schema": schema}],
              tool_choice={"type": "tool", "name": "verdict"})
    message = create(think_client, model=THINK, **kw)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == think_model.reasoning
    jsonschema.validate(message.content[1].input, schema)
    assert message.stop_reason == "tool_use"
    _, final, _ = streamed(think_client, model=THINK, **kw)
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == message.content[1].input and final.stop_reason == "tool_use"
    # The reply sent back (thinking and tool_use blocks), with the tool's result, is accepted.
    turns = [*USER, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[1].id,
                                           "content": "yes"}]}]
    follow = create(think_client, model=THINK, messages=turns, max_tokens=40)
    assert follow.content[0].thinking == think_model.reasoning


# ---- tool_choice auto (--enable-auto-tool-choice --tool-call-parser) ---------------------------

def test_auto_tool_use_after_thinking(servers: dict[str, ServerProcess]) -> None:
    """The agent's path: tools offered (tool_choice defaults to auto), the model thinks and calls
    one in its own format; the parser makes it a tool_use block, whole and streamed."""
    client = anthropic.Anthropic(base_url=servers["agent"].base_url, api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kw = dict(max_tokens=40, tools=[{"name": "verdict", "input_schema": schema}])
    message = create(client, **kw)
    thinking, use = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", AGENT_REASONING)
    assert (use.type, use.name, use.input) == ("tool_use", "verdict", {"ok": True})
    assert message.stop_reason == "tool_use"
    _, final, events = streamed(client, **kw)
    assert without_ids(final) == without_ids(message) and final.stop_reason == "tool_use"
    kinds = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert kinds == {"thinking_delta", "input_json_delta"}
    without_tools = create(client, max_tokens=40)  # no tools: the call is just text
    assert [b.type for b in without_tools.content] == ["thinking", "text"]
    assert without_tools.content[1].text == "<tool_call>" + AGENT_CALL + "</tool_call>"
