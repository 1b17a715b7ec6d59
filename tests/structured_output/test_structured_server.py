"""Structured output and tool calling through a real ``pagoda serve`` and the official client."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from schemas import make_schemas

from server_helpers import ServerProcess

# A chat template that renders tools (Hermes style), tool calls and tool results, so a test can
# see the tools reach the prompt.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "{{ t['function']['parameters'] | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMA_OF = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "tools-model"


@pytest.fixture(scope="module")
def tools_model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tools-model") / "m"
    shutil.copytree(llama_dir, out)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return out


def _tools_server(model_dir: Path, logs: Path, parser: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir, logs, "--served-model-name", MODEL,
                         "--enable-auto-tool-choice", "--tool-call-parser", parser, "--max-model-len", "1024")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _tools_server(tools_model_dir, tmp_path_factory.mktemp("logs"), "hermes")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def _valid(schema: dict, text: str) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def _stream_text(client: openai.OpenAI, **kw) -> tuple[str, str]:
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_response_format_json_schema_chat_and_completions(client: openai.OpenAI) -> None:
    schemas = make_schemas(6, seed=11, max_depth=2)
    for i, schema in enumerate(schemas):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        kw = dict(model=MODEL, messages=USER, max_tokens=400, temperature=0 if i % 2 else 1.0, seed=i,
                  response_format=fmt)
        reply = client.chat.completions.create(**kw)
        assert reply.choices[0].finish_reason == "stop"
        _valid(schema, reply.choices[0].message.content)
        if i < 3:  # streamed: the concatenated deltas are the document
            text, reason = _stream_text(client, **kw)
            assert reason == "stop"
            _valid(schema, text)
        done = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=400, temperature=1.0, seed=i,
                                         extra_body={"response_format": fmt})
        _valid(schema, done.choices[0].text)


def test_json_object_and_structured_outputs_extension(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=300, temperature=0,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")
    out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, n=3, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert all(c.text in ("alpha", "beta", "gamma") and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}})
    import re

    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", out.choices[0].text)


class Step(BaseModel):
    explanation: str = Field(max_length=20)
    output: int = Field(ge=0, le=1000)


class Answer(BaseModel):
    steps: list[Step] = Field(max_length=2)
    final: str = Field(max_length=10)
    confident: bool


def test_openai_client_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    parsed = client.beta.chat.completions.parse(model=MODEL, messages=USER, max_tokens=400, temperature=0,
                                                response_format=Answer)
    answer = parsed.choices[0].message.parsed
    assert isinstance(answer, Answer) and len(answer.steps) <= 2


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "minItems": 2,
                                                                                "maxItems": 1}}}],
      "tool_choice": "required"}, "tools"),
])
def test_invalid_constraints_are_400_naming_the_problem(server: ServerProcess, body: dict, param: str) -> None:
    resp = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": USER, "max_tokens": 5, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text
    assert httpx.get(server.base_url + "/health").status_code == 200


def chain_grammar(rules: int) -> str:
    """``rules`` Lark rules, each referring to the next: deep enough (5,000) to overflow a
    grammar compiler's native stack."""
    return ("start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(rules - 1))
            + f'r{rules - 1}: "a"\n')


# Constraints that compile but cannot be followed (a grammar that can only recurse, schemas that
# refer only to themselves, a regex too big for the lexer), or are too big, or can never end (no
# finite text, though every step has a choice): each refused up front.
PATHOLOGICAL = {
    "endless grammar": {"grammar": 'start: "a" start'},
    "endless grammar with choices": {"grammar": 'start: ("a" | "b") start'},
    "endless rule behind a repeat": {"grammar": 'start: x+ "c"\nx: /[a-z]/ x'},
    "self-referring schema": {"json": {"$ref": "#"}},
    "$ref cycle": {"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    "huge regex": {"regex": "(a{1000}){1000}"},
    "1 MB of choices": {"choice": [f"{i:04d}" + "x" * 1020 for i in range(1000)]},
    # finite texts longer than the context, or than the request's max_tokens (8)
    "minLength 100000": {"json": {"type": "string", "minLength": 100_000}},
    "minItems 100000": {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 100_000}},
    "nested required objects": {"json": {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "object", "required": ["b"], "properties": {"b": {"type": "string", "minLength": 50_000}}}}}},
    "a{20000}": {"regex": "a{20000}"},
    "minLength 600 in 8 tokens": {"json": {"type": "string", "minLength": 600}},
}


def _stream_lines(base_url: str, out: list[str]) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 48, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300) as resp:
        out.extend(line for line in resp.iter_lines() if line)


def _complete(server: ServerProcess, structured_outputs: dict, **kw: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=300,
                      json={"model": MODEL, "prompt": "Go", "max_tokens": 8, "structured_outputs": structured_outputs,
                            **kw})


def test_grammar_that_crashes_the_compiler_is_400_and_others_stream_on(server: ServerProcess) -> None:
    """5,000 chained rules overflow the grammar compiler's stack: the sandbox worker dies, the
    request gets a 400, and a stream running meanwhile ends normally with [DONE]."""
    lines: list[str] = []
    streamer = threading.Thread(target=_stream_lines, args=(server.base_url, lines))
    streamer.start()
    resp = _complete(server, {"grammar": chain_grammar(5000)})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "structured_outputs"
    assert "crashed" in resp.json()["error"]["message"]
    streamer.join()
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    assert server.proc.poll() is None and httpx.get(server.base_url + "/health").status_code == 200
    again = _complete(server, {"grammar": chain_grammar(5000)})  # remembered: refused at once
    assert again.status_code == 400 and again.json()["error"]["message"] == resp.json()["error"]["message"]


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_constraints_are_refused_up_front(server: ServerProcess, name: str) -> None:
    resp = _complete(server, PATHOLOGICAL[name])
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "structured_outputs", resp.text
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = _complete(server, {"choice": ["yes", "no"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_constraint_stopped_by_a_limit_while_running_is_a_4xx(server: ServerProcess, stream: bool) -> None:
    """A grammar whose limit is reached only after 20 tokens passes the up-front checks (its
    self-referring schema is opaque to the length check); the limit then ends that request alone
    with a 400 (an error event when streaming), never a 500."""
    resp = _complete(server, {"grammar": 'start: ("b" | "c")~20 %json {"$ref": "#"}'}, max_tokens=60,
                     temperature=0, stream=stream)
    if stream:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {") and '"error"' in line]
        assert events and events[-1]["error"]["code"] != "request_failed", resp.text
        assert "grammar limits" in events[-1]["error"]["message"]
    else:
        assert resp.status_code == 400, resp.text
        assert "grammar limits" in resp.json()["error"]["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def _calls_of_stream(client: openai.OpenAI, **kw) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                if d.function is not None:
                    call["name"] = call["name"] or d.function.name
                    call["arguments"] += d.function.arguments or ""
    return calls, reason, content


def _accumulated(client: openai.OpenAI, **kw) -> tuple[Any, dict[int, int]]:
    """The completion the official client's stream accumulation (``ChatCompletionStreamState``,
    what ``client.chat.completions.stream`` uses) builds from a stream, and how many deltas
    carried each tool call's arguments."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, pieces = ChatCompletionStreamState(), {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.function is not None and d.function.arguments:
                    pieces[d.index] = pieces.get(d.index, 0) + 1
    return state.get_final_completion(), pieces


def _tool_calls(completion: Any) -> tuple[str | None, list[tuple[str, str, str]]]:
    choice = completion.choices[0]
    return choice.finish_reason, [(c.type, c.function.name, c.function.arguments)
                                  for c in choice.message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_parse(client: openai.OpenAI, choice: str) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                  temperature=1.0, seed=seed)
        reply = client.chat.completions.create(**kw)
        msg, finish = reply.choices[0].message, reply.choices[0].finish_reason
        assert finish == "tool_calls" and msg.tool_calls, reply
        for call in msg.tool_calls:
            assert call.id and call.type == "function"
            assert choice == "required" or call.function.name == "add"
            _valid(SCHEMA_OF[call.function.name], call.function.arguments)
        streamed, reason, _ = _calls_of_stream(client, **kw)
        assert reason == "tool_calls"
        accumulated, pieces = _accumulated(client, **kw)
        assert _tool_calls(accumulated) == _tool_calls(reply)  # the same arguments text exactly
        assert all(n > 1 for n in pieces.values())  # streamed as written, not in one piece
        # Seeded: the streamed calls are the same calls.
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        assert all(c["id"] for c in streamed.values())


def test_auto_tool_choice_with_the_hermes_parser(client: openai.OpenAI, server: ServerProcess) -> None:
    """The model writes a Hermes call itself (a grammar makes this random model do it); the parser
    finds it, streamed and not, and the tools reached the prompt through the template."""
    grammar = ('start: "<tool_call>" call "</tool_call>"\n'
               'call: %json {"type": "object", "properties": {"name": {"const": "add"}, "arguments": '
               + json.dumps(ADD) + '}, "required": ["name", "arguments"], "additionalProperties": false, '
               '"x-guidance": {"whitespace_flexible": false}}')
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5,
              extra_body={"structured_outputs": {"grammar": grammar}})
    reply = client.chat.completions.create(**kw)
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, reply
    assert msg.tool_calls[0].function.name == "add"
    _valid(ADD, msg.tool_calls[0].function.arguments)
    streamed, reason, content = _calls_of_stream(client, **kw)
    assert reason == "tool_calls" and content == ""
    assert json.loads(streamed[0]["arguments"]) == json.loads(msg.tool_calls[0].function.arguments)
    # The official client's stream accumulation gives the same call; its arguments came in pieces.
    accumulated, pieces = _accumulated(client, **kw)
    assert _tool_calls(accumulated) == _tool_calls(reply) and pieces[0] > 3
    # Without a call the reply is plain content.
    plain = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[a-z ]{3,8}"}})
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    # The tools were rendered into the prompt: it is longer than the same prompt without them.
    with_tools = reply.usage.prompt_tokens
    without = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1).usage.prompt_tokens
    assert with_tools > without + 20


def test_tool_result_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*USER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.fixture(scope="module")
def llama3_server(tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _tools_server(tools_model_dir, tmp_path_factory.mktemp("logs3"), "llama3_json")


def test_auto_tool_choice_with_the_llama3_json_parser(llama3_server: ServerProcess) -> None:
    """``--tool-call-parser llama3_json`` end to end: the model writes Llama 3 JSON calls (two,
    ``;``-separated; a grammar makes this random model do it); the reply carries both calls,
    and the streamed calls accumulate (official client) to the same ones."""
    client = openai.OpenAI(base_url=llama3_server.base_url + "/v1", api_key="x", max_retries=0)
    call = ('{"type": "object", "properties": {"name": {"const": "add"}, "parameters": ' + json.dumps(ADD)
            + '}, "required": ["name", "parameters"], "additionalProperties": false, '
            '"x-guidance": {"whitespace_flexible": false}}')
    grammar = f'start: call "; " call\ncall: %json {call}'
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0, seed=3,
              extra_body={"structured_outputs": {"grammar": grammar}})
    reply = client.chat.completions.create(**kw)
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 2, reply
    assert msg.content is None and len({c.id for c in msg.tool_calls}) == 2
    for c in msg.tool_calls:
        assert c.function.name == "add"
        _valid(ADD, c.function.arguments)
    accumulated, pieces = _accumulated(client, **kw)
    assert _tool_calls(accumulated) == _tool_calls(reply) and set(pieces) == {0, 1}
