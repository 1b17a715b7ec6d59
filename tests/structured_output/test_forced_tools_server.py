"""Forced tool calls (``tool_choice`` ``"required"`` or named) and the default tool parser through
a plain ``pagoda serve`` (no tool flags) and the official client, on a scripted model
(tests/conftest.py ``tool_call_model``) whose greedy output is
``[{"name":"get_weather","parameters":{"city":"Paris","units":"C"}}`` then EOS: the grammar
decides what of it survives."""
from __future__ import annotations

import json
from typing import Any, Iterator

import openai
import pytest
from pydantic import BaseModel

from pagoda.entrypoints.openai.server import serve_parser
from server_helpers import ServerProcess

MODEL = "tool-call-model"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # keys not closed
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tool_call_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = tmp_path_factory.mktemp("forced-tools-logs")
    proc = ServerProcess(tool_call_model.path, logs, "--served-model-name", MODEL, "--max-model-len", "256")
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="x", max_retries=0)
    finally:
        proc.stop()


class GetWeather(BaseModel):
    city: str


@pytest.mark.parametrize("parallel", [True, False])
def test_required_call_ends_after_a_complete_call_and_parses(client: openai.OpenAI, parallel: bool) -> None:
    """The model stops (EOS) right after its call; with the closed-array grammar it went on
    writing calls until max_tokens and parse raised LengthFinishReasonError."""
    reply = client.chat.completions.parse(
        model=MODEL, messages=USER, tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
        tool_choice="required", parallel_tool_calls=parallel, max_tokens=100, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.parsed_arguments == GetWeather(city="Paris")


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_undeclared_keys_are_refused_by_default(client: openai.OpenAI, choice: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice,
                                           max_tokens=40, temperature=0)
    for call in reply.choices[0].message.tool_calls:
        assert set(json.loads(call.function.arguments)) <= {"city"}  # the script's "units" was refused


def test_required_call_cut_by_max_tokens_has_one_shape_streamed_and_not(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=2, temperature=0)
    reply = client.chat.completions.create(**kw).choices[0]
    assert reply.finish_reason == "length" and reply.message.content is None
    whole = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert whole == [("get_weather", '{"city":')]  # the arguments generated so far
    assert _streamed(client, **kw) == ("", whole, "length")
    # Cut after the name, before the arguments begin: the call with empty arguments.
    kw["max_tokens"] = 1
    reply = client.chat.completions.create(**kw).choices[0]
    whole = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert reply.finish_reason == "length" and whole == [("get_weather", "")]
    assert _streamed(client, **kw) == ("", whole, "length")


def test_named_call_cut_by_max_tokens_has_one_shape_streamed_and_not(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=2, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**kw).choices[0]
    assert reply.finish_reason == "length" and reply.message.content is None
    whole = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert len(whole) == 1 and whole[0][0] == "get_weather" and whole[0][1]
    assert _streamed(client, **kw) == ("", whole, "length")


def test_strict_tool_arguments_flag() -> None:
    assert serve_parser().parse_args([]).strict_tool_arguments is True
    assert serve_parser().parse_args(["--no-strict-tool-arguments"]).strict_tool_arguments is False


def test_plain_server_takes_tool_choice_auto_with_the_parser_its_template_shows(client: openai.OpenAI) -> None:
    """No --enable-auto-tool-choice / --tool-call-parser: the template shows <tool_call> blocks, so
    the server reads calls with hermes. The script is no hermes block: plain content."""
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=20, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == '[{"name":"get_weather","parameters":{"city":"Paris","units":"C"}}'
