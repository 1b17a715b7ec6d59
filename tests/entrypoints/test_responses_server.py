"""The Responses API (``/v1/responses``) of a real ``pagoda serve`` through the official ``openai``
client: greedy outputs equal chat completions of the same conversation, streaming events in
OpenAI's order joining to the whole response, ``text.format``, function tools and their round
trip, ``previous_response_id``, the store (GET, DELETE), background runs and their cancel, the
reasoning item on a scripted thinking checkpoint, and LangChain's ``use_responses_api``."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_helpers import ServerProcess, engine_pid, frozen, side_by_side

MODEL = "m"
# ChatML that renders tools, tool calls and tool results, so they reach the prompt.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "{{ t['function']['parameters'] | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                            "score": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["ok", "score"], "additionalProperties": False}
ADD_TOOL = {"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD, "strict": True}
STORY = "Tell me a story."


@pytest.fixture(scope="module")
def servers(llama_dir: Path, think_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, ServerProcess]]:
    """plain: this module's own server; think: the session's thinking server (served as ``m``)."""
    model = tmp_path_factory.mktemp("responses-model") / "m"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    logs = tmp_path_factory.mktemp("responses-logs")
    started = {"plain": ServerProcess(model, logs, "--served-model-name", MODEL, "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes", "--max-stored-responses", "16")}
    with side_by_side(started, shared=(think_server,)) as ready:
        yield {**ready, "think": think_server}


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["plain"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def respond(client: openai.OpenAI, **kw: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **kw)


def check_equal_to_chat(response: Any, completion: Any) -> None:
    choice = completion.choices[0]
    assert response.output_text == choice.message.content
    assert response.status == ("completed" if choice.finish_reason == "stop" else "incomplete")
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


# ---- whole responses ---------------------------------------------------------------------------

def test_string_input_equals_chat(client: openai.OpenAI) -> None:
    response = respond(client, input=STORY, max_output_tokens=12)
    check_equal_to_chat(response, chat(client, [{"role": "user", "content": STORY}], 12))
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []


def test_messages_and_instructions_equal_chat(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": STORY}]}]
    response = respond(client, input=items, instructions="Be brief.", max_output_tokens=10)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": STORY}]
    check_equal_to_chat(response, chat(client, messages, 10))
    assert response.instructions == "Be brief."


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    response = respond(client, input=STORY, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"


# ---- streaming ---------------------------------------------------------------------------------

def test_stream_events_in_order_join_to_the_whole_response(client: openai.OpenAI) -> None:
    whole = respond(client, input=STORY, max_output_tokens=12)
    events = list(respond(client, input=STORY, max_output_tokens=12, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # streamed ones are kept too
    # The SDK's stream helper accumulates the same text from the events (its final response
    # needs response.completed: an incomplete one ends with response.incomplete, as OpenAI's).
    with client.responses.stream(model=MODEL, input=STORY, max_output_tokens=12, temperature=0) as stream:
        helped = list(stream)
    snapshots = [e.snapshot for e in helped if e.type == "response.output_text.delta"]
    assert snapshots[-1] == whole.output_text
    assert helped[-1].type == events[-1].type


def test_stream_is_sse_with_event_lines(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": STORY, "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]


# ---- structured output and tools ---------------------------------------------------------------

def test_json_schema_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    response = respond(client, input="Judge it.", text={"format": fmt}, max_output_tokens=60)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), VERDICT)

    class Verdict(BaseModel):
        ok: bool
        score: int = Field(ge=0, le=9)  # bounded: a random model would write digits until the limit

    parsed = client.responses.parse(model=MODEL, input="Judge it.", text_format=Verdict, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Verdict)
    json_object = respond(client, input="Judge it.", text={"format": {"type": "json_object"}}, max_output_tokens=60)
    # Any JSON object: a random model may still be inside a long key at the limit.
    assert json_object.output_text.startswith("{")
    assert json_object.status == "incomplete" or isinstance(json.loads(json_object.output_text), dict)


def test_named_function_call_and_its_round_trip(client: openai.OpenAI) -> None:
    user = {"role": "user", "content": "What is 2 + 3?"}
    first = respond(client, input=[user], tools=[ADD_TOOL], tool_choice={"type": "function", "name": "add"},
                    max_output_tokens=40)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "add" and call.call_id
    jsonschema.validate(json.loads(call.arguments), ADD)
    # The call and its result go back as input; the prompt grows by both.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    second = respond(client, input=[user, call.model_dump(exclude_none=True), result], tools=[ADD_TOOL],
                     tool_choice="none", max_output_tokens=8)
    assert second.status in ("completed", "incomplete") and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + 5
    # The same round trip through chat completions gives the same reply.
    messages = [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
    same = client.chat.completions.create(model=MODEL, messages=messages, tools=[
        {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD,
                                          "strict": True}}], tool_choice="none", max_tokens=8, temperature=0)
    check_equal_to_chat(second, same)


def test_streamed_function_call(client: openai.OpenAI) -> None:
    kw = dict(input="What is 2 + 3?", tools=[ADD_TOOL], tool_choice="required", max_output_tokens=60)
    whole = respond(client, **kw)
    events = list(respond(client, stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in added] == [i.type for i in done] == [i.type for i in whole.output]
    assert all(i.type == "function_call" for i in done) and done
    for index, item in enumerate(done):
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.output_index == index)
        assert deltas == item.arguments == whole.output[index].arguments
        assert item.name == whole.output[index].name
        jsonschema.validate(json.loads(item.arguments), ADD)
    assert events[-1].type == "response.completed"


# ---- the store ---------------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = respond(client, input="Hi", instructions="Be brief.", max_output_tokens=6)
    second = respond(client, input=STORY, previous_response_id=first.id, max_output_tokens=8)
    # The earlier turn (not its instructions) comes before the new input.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": STORY}]
    check_equal_to_chat(second, chat(client, messages, 8))
    assert second.previous_response_id == first.id
    third = respond(client, input="More.", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_get_and_delete_a_stored_response(client: openai.OpenAI) -> None:
    response = respond(client, input=STORY, max_output_tokens=5)
    got = client.responses.retrieve(response.id)
    assert (got.id, got.output_text, got.status) == (response.id, response.output_text, response.status)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = respond(client, input=STORY, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_unknown_previous_response_is_an_openai_shaped_400(server: ServerProcess) -> None:
    r = httpx.post(server.base_url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"},
                   timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
    assert "resp_nope" in error["message"]
    assert httpx.get(server.base_url + "/v1/responses/resp_nope", timeout=30).status_code == 404


def test_the_store_is_bounded(client: openai.OpenAI) -> None:
    first = respond(client, input="Hi", max_output_tokens=1)
    for _ in range(16):  # the server keeps 16
        respond(client, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


# ---- background --------------------------------------------------------------------------------

def wait_done(client: openai.OpenAI, response_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.1)
    raise AssertionError(f"{response_id} still {response.status}")


def test_background_poll_and_cancel(server: ServerProcess, client: openai.OpenAI) -> None:
    whole = respond(client, input=STORY, max_output_tokens=10)
    started = respond(client, input=STORY, max_output_tokens=10, background=True)
    assert started.status in ("queued", "in_progress") and started.background
    done = wait_done(client, started.id)
    assert (done.status, done.output_text) == (whole.status, whole.output_text)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(whole.id)  # only background responses can be cancelled
    with frozen(engine_pid(server.base_url)):  # nothing can finish while the engine is paused
        running = respond(client, input=STORY, max_output_tokens=200, background=True)
        cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert respond(client, input=STORY, max_output_tokens=10).output_text == whole.output_text


# ---- field policy ------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_p": True}, "top_p"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "input"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [ADD_TOOL]}, "tool_choice"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_bad_fields_are_400s_naming_them(server: ServerProcess, body: dict, param: str) -> None:
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_input_image_to_a_text_only_model_is_a_400_saying_so(client: openai.OpenAI) -> None:
    image = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/"
             "iZk9HQAAAABJRU5ErkJggg==")
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": image,
                                                               "detail": "auto"}]}])
    assert err.value.body["param"] == "input" and "takes text only" in err.value.body["message"]


def test_unknown_fields_are_ignored(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2, "service_tier": "auto", "include": [],
            "text": {"format": {"type": "text"}, "verbosity": "low"}, "metadata": {"k": "v"}, "user": "u",
            "reasoning": {"effort": "low"}, "some_new_field": {"a": 1}}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["usage"]["output_tokens"] == 2
    assert "pagoda does not know: " in server.log() and "'some_new_field'" in server.log()


# ---- reasoning ---------------------------------------------------------------------------------

def test_reasoning_item_precedes_the_message(servers: dict[str, ServerProcess], think_model) -> None:
    client = openai.OpenAI(base_url=servers["think"].base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    response = respond(client, input="Is it so?", max_output_tokens=40)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == think_model.reasoning
    assert message.type == "message" and response.output_text == think_model.answer
    usage = response.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    events = list(respond(client, input="Is it so?", max_output_tokens=40, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == think_model.reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == think_model.answer
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    # The reply sent back as input (reasoning item included) continues the conversation.
    follow = respond(client, input=[{"role": "user", "content": "Is it so?"},
                                    *[i.model_dump(exclude_none=True) for i in response.output],
                                    {"role": "user", "content": "Sure?"}], max_output_tokens=40)
    assert follow.output[0].content[0].text == think_model.reasoning


def comparable(response: Any) -> dict[str, Any]:
    """A response without what differs between two runs of the same request (ids, times)."""
    body = response.model_dump(exclude={"id", "created_at"})
    for item in body["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)  # the stream helper's own field (text.format parsing)
    return body


@pytest.mark.parametrize("summary", [None, "auto"])
def test_streamed_reasoning_assembles_the_whole_response(servers: dict[str, ServerProcess], think_model,
                                                         summary: str | None) -> None:
    """The official client's ``responses.stream`` builds, from the events, a final response equal
    to the non-streamed one; the reasoning item's events come in OpenAI's order."""
    client = openai.OpenAI(base_url=servers["think"].base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw: dict[str, Any] = {"input": "Is it so?", "max_output_tokens": 40}
    if summary is not None:
        kw["reasoning"] = {"summary": summary}
    whole = respond(client, **kw)
    with client.responses.stream(model=MODEL, temperature=0, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert comparable(final) == comparable(whole)
    reasoning_events = [e.type for e in events if getattr(e, "output_index", None) == 0]
    expected = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                "response.reasoning_text.done", "response.content_part.done"]
    if summary is not None:
        expected += ["response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
                     "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
        assert final.output[0].summary[0].text == think_model.reasoning
    deltas = reasoning_events.count("response.reasoning_text.delta")
    assert [t for i, t in enumerate(reasoning_events) if t != "response.reasoning_text.delta"
            or reasoning_events[i - 1] != t] == expected + ["response.output_item.done"]
    assert deltas >= 1 and [e.sequence_number for e in events] == list(range(len(events)))


# ---- LangChain ---------------------------------------------------------------------------------

def test_langchain_use_responses_api(server: ServerProcess, client: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI  # in the test extra

    llm = ChatOpenAI(model=MODEL, base_url=server.base_url + "/v1", api_key="x",
                                      use_responses_api=True, temperature=0, max_tokens=8, max_retries=0)
    message = llm.invoke(STORY)
    assert message.text == respond(client, input=STORY, max_output_tokens=8).output_text
    assert "".join(chunk.text for chunk in llm.stream(STORY)) == message.text
