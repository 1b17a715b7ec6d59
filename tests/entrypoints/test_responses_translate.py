"""The Responses translator without a server: input items -> chat messages, a response's output
-> the assistant turn it adds, the chat request a Responses request becomes, the bounded store."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagoda.entrypoints.openai.responses_protocol import (OutputFunctionCall, OutputMessage, OutputReasoning,
                                                          OutputText, ReasoningPart, ResponsesRequest)
from pagoda.entrypoints.openai.serving_responses import (ResponseStore, Stored, chat_request, input_messages,
                                                         output_messages)


def test_items_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "2+3?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":3}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":0,"b":0}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "5", "annotations": []}]},
    ]})
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}},
             {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a":0,"b":0}'}}]
    assert input_messages(req.input) == [
        {"role": "user", "content": "2+3?"},
        # The reasoning goes with the turn it preceded; consecutive calls are one turn.
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "hmm"},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_output_becomes_one_assistant_turn() -> None:
    output = [OutputReasoning(id="rs", content=[ReasoningPart(text="think")]),
              OutputMessage(id="m", content=[OutputText(text="Sure.")]),
              OutputFunctionCall(id="fc", call_id="c9", name="f", arguments="{}")]
    assert output_messages(output) == [{"role": "assistant", "content": "Sure.", "reasoning_content": "think",
                                        "tool_calls": [{"id": "c9", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}]}]
    assert output_messages([]) == [{"role": "assistant", "content": ""}]


def test_chat_request_of_a_responses_request() -> None:
    req = ResponsesRequest.model_validate({
        "input": "x", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5, "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}}})
    chat = chat_request(req, [{"role": "user", "content": "x"}])
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == (7, 0, 0.5, False)
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.strict is True
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.json_schema == {
        "type": "object"}


@pytest.mark.parametrize("body", [
    {"input": "x", "max_output_tokens": 0},
    {"input": "x", "stream": "yes"},
    {"input": [{"type": "item_reference", "id": "x"}]},
    {"input": [{"role": "tool", "content": "x"}]},
    {"input": "x", "metadata": {"k": 1}},
])
def test_known_fields_are_strict(body: dict) -> None:
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate(body)


def test_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(2)
    a, b, c = (Stored(builder=None) for _ in range(3))  # type: ignore[arg-type]
    store.put("a", a)
    store.put("b", b)
    assert store.get("a") is a  # now the most recent
    store.put("c", c)
    assert store.get("b") is None and store.get("a") is a and store.get("c") is c
    assert store.pop("a") is a and store.get("a") is None
    empty = ResponseStore(0)
    empty.put("a", a)
    assert empty.get("a") is None
