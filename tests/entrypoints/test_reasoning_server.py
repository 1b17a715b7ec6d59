"""``pagoda serve --reasoning-parser`` through the official ``openai`` client, on a scripted
checkpoint whose greedy reply is ``<think>Let me think</think> The answer``: the reasoning goes
to ``reasoning_content``, the answer to ``content``, in whole and streamed replies alike; an output
cut off inside the reasoning is all reasoning; ``response_format`` and forced tool calls shape the
answer after the reasoning, which stays free text."""
from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from server_helpers import ServerProcess, side_by_side

PARSERS = ("deepseek_r1", "qwen3")
MESSAGES = [{"role": "user", "content": "Is it so?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(think_model, think_server: ServerProcess,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """deepseek_r1: the session's thinking server; qwen3: one of this module's own."""
    logs = tmp_path_factory.mktemp("reasoning-logs")
    started = {name: ServerProcess(think_model.path, logs, "--reasoning-parser", name,
                                 "--served-model-name", "m") for name in PARSERS if name != "deepseek_r1"}
    with side_by_side(started, shared=(think_server,)) as ready:
        yield {**ready, "deepseek_r1": think_server}


@pytest.fixture(scope="module", params=PARSERS)
def client(request: pytest.FixtureRequest, servers: dict[str, ServerProcess]) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers[request.param].base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def whole(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, **kw).choices[0]


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, str, str | None, list[Any]]:
    """(reasoning, content, finish reason, deltas) of a streamed reply."""
    reasoning, content, finish, deltas = "", "", None, []
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, stream=True, **kw):
        for choice in chunk.choices:
            deltas.append(choice.delta)
            reasoning += reasoning_of(choice.delta) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish, deltas


def test_reasoning_and_answer_split(client: openai.OpenAI, think_model) -> None:
    choice = whole(client)
    assert reasoning_of(choice.message) == think_model.reasoning
    assert choice.message.content == think_model.answer
    assert choice.finish_reason == "stop"


def test_stream_deltas_join_to_the_whole_reply(client: openai.OpenAI, think_model) -> None:
    reasoning, content, finish, deltas = streamed(client)
    choice = whole(client)
    assert (reasoning, content, finish) == (reasoning_of(choice.message), choice.message.content,
                                            choice.finish_reason)
    # Reasoning comes before any answer (the engine may send several tokens in one delta: the
    # split then happens inside it), and no tag leaks into either part.
    kinds = ["r" if reasoning_of(d) else "c" for d in deltas if reasoning_of(d) or d.content]
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds
    assert not any("think>" in (reasoning_of(d) or "") + (d.content or "") for d in deltas)


def test_cut_off_inside_the_reasoning_is_all_reasoning(client: openai.OpenAI, think_model) -> None:
    choice = whole(client, max_tokens=4)
    assert choice.finish_reason == "length"
    assert think_model.reasoning.startswith(reasoning_of(choice.message))
    assert choice.message.content is None
    reasoning, content, finish, _ = streamed(client, max_tokens=4)
    assert (reasoning, content or None, finish) == (reasoning_of(choice.message), None, "length")


def test_json_schema_applies_after_the_reasoning(client: openai.OpenAI, think_model) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    choice = whole(client, response_format=fmt, max_tokens=40)
    # Free reasoning (a grammar from the first token would have allowed only "{"), then JSON.
    assert reasoning_of(choice.message) == think_model.reasoning
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"
    reasoning, content, finish, _ = streamed(client, response_format=fmt, max_tokens=40)
    assert (reasoning, content, finish) == (reasoning_of(choice.message), choice.message.content, "stop")


def test_named_tool_call_after_the_reasoning(client: openai.OpenAI, think_model) -> None:
    tools = [{"type": "function", "function": {"name": "verdict", "parameters": SCHEMA}}]
    choice = whole(client, tools=tools, tool_choice={"type": "function", "function": {"name": "verdict"}},
                   max_tokens=40)
    assert reasoning_of(choice.message) == think_model.reasoning
    (call,) = choice.message.tool_calls
    assert call.function.name == "verdict"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_a_reply_sent_back_is_accepted(client: openai.OpenAI, think_model) -> None:
    """The next turn may carry the previous reply as the client got it, reasoning included."""
    first = whole(client).message
    follow_up = client.chat.completions.create(
        model="m", temperature=0, max_tokens=40,
        messages=[*MESSAGES, first.model_dump(exclude_unset=True), {"role": "user", "content": "Sure?"}])
    assert reasoning_of(follow_up.choices[0].message) == think_model.reasoning
