"""gpt-oss's harmony format end to end: two scripted checkpoints whose tokenizers have harmony's
markers as special tokens and whose chat template shows harmony tool calls (so ``--tool-call-parser
auto``, the default, picks ``openai`` and with it the ``openai_gptoss`` reasoning split). One
writes analysis then a final answer, the other analysis then a call to ``get_weather``. Through
the official ``openai`` (chat, Responses) and ``anthropic`` clients, whole and streamed: the
parts land in reasoning / content / calls and no marker leaks anywhere."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest

from server_helpers import ServerProcess, side_by_side

MODEL = "oss"
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")
# A harmony-shaped template: the tools in a developer message that shows the call format.
TEMPLATE = ("{%- for message in messages -%}<|start|>{{ message.role }}<|message|>{{ message.content or '' }}<|end|>"
            "{%- endfor -%}{%- if tools %}<|start|>developer<|message|>Call a tool as to=functions.NAME:"
            "{% for t in tools %} {{ t.function.name }}{% endfor %}<|end|>{% endif -%}"
            "{%- if add_generation_prompt %}<|start|>assistant{% endif -%}")
REASONING, ANSWER, CALL_REASONING = "Let me think", " The answer", "Need the weather"
ARGS = ('{"city":', ' "Paris"}')
# The scripted model cannot write one token twice, so the analysis header is written as plain
# text that reads the same ("<|" "channel|>" ...: the split reads text), and the later header with
# the real marker tokens, which a grammar's start watches for (as it does in a real gpt-oss output).
HEADER_AS_TEXT = ("<|", "channel|>", "analysis", "<|m", "essage|>")
ANSWER_PIECES = (*HEADER_AS_TEXT, REASONING, "<|end|>", "<|start|>assistant", "<|channel|>",
                 "final", "<|message|>", ANSWER, "<|return|>")
CALL_PIECES = (*HEADER_AS_TEXT, CALL_REASONING, "<|end|>", "<|start|>assistant",
               "<|channel|>", "commentary", " to=functions.get_weather", " ", "<|constrain|>", "json", "<|message|>",
               *ARGS, "<|call|>")
WORDS = ("assistant", "analysis", "final", "commentary", "json", REASONING, ANSWER, CALL_REASONING,
         " to=functions.get_weather", *ARGS, *HEADER_AS_TEXT[:2], *HEADER_AS_TEXT[3:])
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather?"}]


def harmony_model(path: Path, pieces: tuple[str, ...]) -> Path:
    from pagoda.tools.scripted_model import make_scripted_model

    return make_scripted_model(path, pieces, trigger="<|start|>assistant", added_tokens=WORDS,
                               chat_template=TEMPLATE, special_tokens=MARKERS, stop_tokens=("<|return|>", "<|call|>"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("harmony-logs")
    answer = harmony_model(tmp_path_factory.mktemp("harmony-answer"), ANSWER_PIECES)
    call = harmony_model(tmp_path_factory.mktemp("harmony-call"), CALL_PIECES)
    started = {"answer": ServerProcess(answer, logs, "--served-model-name", MODEL, "--reasoning-parser",
                                       "openai_gptoss", "--tool-call-parser", "openai"),
               "call": ServerProcess(call, logs, "--served-model-name", MODEL)}  # both parsers found: auto
    with side_by_side(started) as ready:
        yield ready


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def no_marker(*texts: str | None) -> bool:
    return not any(m in (t or "") for t in texts for m in ("<|", "|>"))


def chat(server: ServerProcess, **kw: Any) -> Any:
    return client_of(server).chat.completions.create(model=MODEL, messages=USER, temperature=0, **kw).choices[0]


def chat_stream(server: ServerProcess, **kw: Any) -> tuple[str, str, dict[int, list[str]], str | None, list[Any]]:
    """(reasoning, content, calls index -> [name, arguments], finish reason, deltas)."""
    reasoning, content, calls, finish, deltas = "", "", {}, None, []
    for chunk in client_of(server).chat.completions.create(model=MODEL, messages=USER, temperature=0, stream=True,
                                                           **kw):
        for choice in chunk.choices:
            d = choice.delta
            deltas.append(d)
            reasoning += reasoning_of(d) or ""
            content += d.content or ""
            for call in d.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish, deltas


def test_reasoning_and_answer_whole_and_streamed(servers: dict[str, ServerProcess]) -> None:
    server = servers["answer"]
    choice = chat(server)
    assert (reasoning_of(choice.message), choice.message.content) == (REASONING, ANSWER)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    reasoning, content, calls, finish, deltas = chat_stream(server)
    assert (reasoning, content, calls, finish) == (REASONING, ANSWER, {}, "stop")
    assert all(no_marker(reasoning_of(d), d.content) for d in deltas)


def test_cut_inside_the_analysis_is_all_reasoning(servers: dict[str, ServerProcess]) -> None:
    server = servers["answer"]
    choice = chat(server, max_tokens=6)  # <| channel|> analysis <|m essage|> "Let me think"
    assert choice.finish_reason == "length"
    assert (reasoning_of(choice.message), choice.message.content) == (REASONING, None)
    choice = chat(server, max_tokens=10)  # cut inside the final message's header
    assert (reasoning_of(choice.message), choice.message.content) == (REASONING, None)
    reasoning, content, _, finish, _ = chat_stream(server, max_tokens=10)
    assert (reasoning, content, finish) == (REASONING, "", "length")


def test_tool_call_with_reasoning_whole_and_streamed(servers: dict[str, ServerProcess]) -> None:
    server = servers["call"]
    assert "the openai tool-call format needs its channels split" in server.log()
    choice = chat(server, tools=TOOLS)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert reasoning_of(choice.message) == CALL_REASONING
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    reasoning, content, calls, finish, deltas = chat_stream(server, tools=TOOLS)
    assert (reasoning, content, finish) == (CALL_REASONING, "", "tool_calls")
    assert calls == {0: ["get_weather", call.function.arguments]}
    assert all(no_marker(reasoning_of(d), d.content) for d in deltas)
    assert all(no_marker(c.function.arguments) for d in deltas for c in d.tool_calls or [])


def test_without_tools_a_call_is_dropped_not_leaked(servers: dict[str, ServerProcess]) -> None:
    choice = chat(servers["call"])
    assert (reasoning_of(choice.message), choice.message.content, choice.message.tool_calls) == \
        (CALL_REASONING, None, [])
    reasoning, content, calls, _, _ = chat_stream(servers["call"])
    assert (reasoning, content, calls) == (CALL_REASONING, "", {})


def test_responses_api(servers: dict[str, ServerProcess]) -> None:
    client = client_of(servers["answer"])
    whole = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=40, temperature=0)
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == REASONING and whole.output_text == ANSWER
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    with client.responses.stream(model=MODEL, input="Weather?", max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert final.output_text == ANSWER and final.output[0].content[0].text == REASONING
    calls = client_of(servers["call"]).responses.create(model=MODEL, input="Weather?", tools=[
        {"type": "function", **TOOLS[0]["function"]}], max_output_tokens=40, temperature=0)
    assert [i.type for i in calls.output] == ["reasoning", "function_call"]
    assert calls.output[1].name == "get_weather" and json.loads(calls.output[1].arguments) == {"city": "Paris"}


def test_messages_api(servers: dict[str, ServerProcess]) -> None:
    client = anthropic.Anthropic(base_url=servers["call"].base_url, api_key="x", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    greedy = {"extra_body": {"temperature": 0}}  # the SDK has no temperature argument
    message = client.messages.create(model=MODEL, max_tokens=40, messages=USER, tools=tools, **greedy)
    assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
    assert message.content[0].thinking == CALL_REASONING and message.content[1].input == {"city": "Paris"}
    with client.messages.stream(model=MODEL, max_tokens=40, messages=USER, tools=tools, **greedy) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[0].thinking == CALL_REASONING and streamed.content[1].input == {"city": "Paris"}


@pytest.mark.parametrize("choice,max_tokens", [("required", 42),
                                               ({"type": "function", "function": {"name": "get_weather"}}, 18)])
def test_forced_call_cut_short_has_one_shape(servers: dict[str, ServerProcess], choice: Any, max_tokens: int) -> None:
    """A forced call's grammar applies after the analysis on a harmony server (to the call's
    body: 17 tokens reach its <|message|>); cut by max_tokens inside the arguments it comes back
    streamed and whole as the same tool call, with the arguments written so far and
    finish_reason "length"."""
    server = servers["call"]
    whole = chat(server, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens)
    reasoning, content, calls, finish, _ = chat_stream(server, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens)
    assert whole.finish_reason == finish == "length"
    assert reasoning_of(whole.message) == reasoning == CALL_REASONING  # the analysis was free
    assert (whole.message.content or "") == content and no_marker(content)
    got = [[c.function.name, c.function.arguments] for c in whole.message.tool_calls]
    assert got == [calls[i] for i in sorted(calls)]
    [(name, arguments)] = got
    assert name == "get_weather" and no_marker(arguments) and arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)  # cut inside the arguments


VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}


def test_json_schema_applies_to_the_final_answer_after_the_analysis(servers: dict[str, ServerProcess]) -> None:
    """response_format shapes the final channel's body; the analysis before it is free (a grammar
    from the first token would have allowed only JSON, and the model skipped its analysis)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    choice = chat(servers["answer"], response_format=fmt, max_tokens=40)
    assert reasoning_of(choice.message) == REASONING and choice.finish_reason == "stop"
    assert set(json.loads(choice.message.content)) == {"ok"}
    assert isinstance(json.loads(choice.message.content)["ok"], bool)
    reasoning, content, calls, finish, _ = chat_stream(servers["answer"], response_format=fmt, max_tokens=40)
    assert (reasoning, content, calls, finish) == (REASONING, choice.message.content, {}, "stop")


def test_named_call_applies_after_the_analysis(servers: dict[str, ServerProcess]) -> None:
    """A named forced call's grammar shapes the body of the model's commentary call message."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "verdict", "parameters": VERDICT}}]
    named = {"type": "function", "function": {"name": "verdict"}}
    choice = chat(servers["call"], tools=tools, tool_choice=named, max_tokens=40)
    assert reasoning_of(choice.message) == CALL_REASONING and choice.finish_reason in ("stop", "tool_calls")
    [call] = choice.message.tool_calls
    assert call.function.name == "verdict" and set(json.loads(call.function.arguments)) == {"ok"}
    reasoning, content, calls, _, _ = chat_stream(servers["call"], tools=tools, tool_choice=named, max_tokens=40)
    assert (reasoning, calls) == (CALL_REASONING, {0: ["verdict", call.function.arguments]})


def test_auto_call_cut_short_has_one_shape(servers: dict[str, ServerProcess]) -> None:
    """tool_choice "auto" cut by max_tokens inside a call's arguments: the call so far, streamed
    and whole alike (18 tokens end after '{"city":')."""
    server = servers["call"]
    choice = chat(server, tools=TOOLS, max_tokens=18)
    assert choice.finish_reason == "length" and choice.message.content is None
    assert reasoning_of(choice.message) == CALL_REASONING
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_weather", ARGS[0])]
    reasoning, content, calls, finish, _ = chat_stream(server, tools=TOOLS, max_tokens=18)
    assert (reasoning, content, calls, finish) == (CALL_REASONING, "", {0: ["get_weather", ARGS[0]]}, "length")
