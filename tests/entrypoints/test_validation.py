"""Hostile requests against a live ``pagoda serve``: every one is refused with a 4xx in OpenAI's
error shape naming the field at fault, and the server (and its engine core) keeps serving a
valid request right after each. Also: a field whose value would matter is refused unless pagoda
implements it, an unknown field is ignored with a warning (``test_request_fields`` has the
``--strict-request-fields`` 400s), the official ``openai`` client's ordinary calls pass, echo +
logprobs has OpenAI's layout, and the OpenAPI document has the statuses the server really sends."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagoda.engine.input_processor import MAX_MESSAGES, MAX_PROMPT_CHARS_PER_TOKEN
from pagoda.entrypoints.openai.protocol import MAX_PROMPTS_PER_REQUEST
from pagoda.sampling_params import (MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SEED_MAX,
                                    SEED_MIN)
from server_helpers import MAX_MODEL_LEN, ServerProcess, engine_pid

MODEL = "tiny"
VOCAB = 512  # conftest's llama spec
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
MAX_CHARS = MAX_PROMPT_CHARS_PER_TOKEN * MAX_MODEL_LEN


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server  # tests/entrypoints/conftest.py: shared with the other request-only modules


@pytest.fixture(scope="module")
def first_engine_pid(server: ServerProcess) -> int:
    return engine_pid(server.base_url)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def raw(body: str) -> bytes:
    return body.encode()


# (name, path, body (a dict, or bytes sent as they are), expected param, a text the message must contain)
HOSTILE: list[tuple[str, str, dict | bytes, str | None, str]] = [
    # -- integers beyond what the engine can represent, and negative ones
    ("top_k 2**63", CMPL, cmpl(top_k=2 ** 63), "top_k", str(VOCAB)),
    ("top_k -2", CMPL, cmpl(top_k=-2), "top_k", ""),
    ("top_k past vocab", CMPL, cmpl(top_k=VOCAB + 1), "top_k", str(VOCAB)),
    ("seed 2**70", CMPL, cmpl(seed=2 ** 70), "seed", ""),
    ("seed below int64", CMPL, cmpl(seed=SEED_MIN - 1), "seed", ""),
    ("seed + n overflows", CMPL, cmpl(seed=SEED_MAX, n=2), "seed", "seed + n - 1"),
    ("n 2**31", CMPL, cmpl(n=2 ** 31), "n", str(MAX_N)),
    ("n 0", CMPL, cmpl(n=0), "n", ""),
    ("n -1", CMPL, cmpl(n=-1), "n", ""),
    ("n past the bound", CHAT, chat(n=MAX_N + 1), "n", str(MAX_N)),
    ("max_tokens 2**63", CMPL, cmpl(max_tokens=2 ** 63), "max_tokens", str(MAX_MODEL_LEN)),
    ("max_tokens 10**30", CMPL, cmpl(max_tokens=10 ** 30), "max_tokens", ""),
    ("max_tokens -1", CMPL, cmpl(max_tokens=-1), "max_tokens", ""),
    ("max_completion_tokens 10**6", CHAT, chat(max_completion_tokens=10 ** 6), "max_completion_tokens", ""),
    ("min_tokens 2**64", CMPL, cmpl(min_tokens=2 ** 64), "min_tokens", ""),
    ("min_tokens -1", CMPL, cmpl(min_tokens=-1), "min_tokens", ""),
    ("logprobs 21", CMPL, cmpl(logprobs=21), "logprobs", "20"),
    ("logprobs 2**63", CMPL, cmpl(logprobs=2 ** 63), "logprobs", ""),
    ("logprobs -1", CMPL, cmpl(logprobs=-1), "logprobs", ""),
    ("echo logprobs 21", CMPL, cmpl(logprobs=21, echo=True), "logprobs", "20"),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs must be at most 20"),
    ("top_logprobs -1", CHAT, chat(logprobs=True, top_logprobs=-1), "top_logprobs", ""),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), "top_logprobs", ""),
    ("stop_token_ids past vocab", CMPL, cmpl(stop_token_ids=[VOCAB]), "stop_token_ids", str(VOCAB)),
    ("stop_token_ids negative", CMPL, cmpl(stop_token_ids=[-1]), "stop_token_ids", ""),
    ("stop_token_ids 2**64", CMPL, cmpl(stop_token_ids=[2 ** 64]), "stop_token_ids", ""),
    # -- NaN and infinities (as JSON tokens Python's parser accepts, and as an overflowing literal)
    ("temperature NaN", CMPL, raw('{"prompt": "x", "temperature": NaN}'), "temperature", ""),
    ("temperature Infinity", CMPL, raw('{"prompt": "x", "temperature": Infinity}'), "temperature", ""),
    ("temperature 1e309", CMPL, raw('{"prompt": "x", "temperature": 1e309}'), "temperature", ""),
    ("temperature too high", CMPL, cmpl(temperature=101), "temperature", ""),
    ("temperature negative", CMPL, cmpl(temperature=-0.5), "temperature", ""),
    ("top_p NaN", CHAT, raw('{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}'), "top_p", ""),
    ("top_p 0", CMPL, cmpl(top_p=0), "top_p", ""),
    ("top_p above 1", CMPL, cmpl(top_p=1.0000001), "top_p", ""),
    ("min_p 1.5", CMPL, cmpl(min_p=1.5), "min_p", ""),
    ("min_p -Infinity", CMPL, raw('{"prompt": "x", "min_p": -Infinity}'), "min_p", ""),
    ("presence_penalty 2.5", CMPL, cmpl(presence_penalty=2.5), "presence_penalty", ""),
    ("presence_penalty -Infinity", CMPL, raw('{"prompt": "x", "presence_penalty": -Infinity}'),
     "presence_penalty", ""),
    ("frequency_penalty 1e309", CHAT, raw('{"messages": [{"role": "user", "content": "x"}], '
                                          '"frequency_penalty": 1e309}'), "frequency_penalty", ""),
    ("repetition_penalty 1e-310", CMPL, cmpl(repetition_penalty=1e-310), "repetition_penalty", ""),
    ("repetition_penalty 0", CMPL, cmpl(repetition_penalty=0), "repetition_penalty", ""),
    ("repetition_penalty 1e300", CMPL, cmpl(repetition_penalty=1e300), "repetition_penalty", ""),
    ("repetition_penalty NaN", CMPL, raw('{"prompt": "x", "repetition_penalty": NaN}'), "repetition_penalty", ""),
    # -- prompts: token ids outside the vocabulary, empty, too many, too long
    ("token id = vocab", CMPL, cmpl(prompt=[5, VOCAB]), "prompt", str(VOCAB)),
    ("token id -1", CMPL, cmpl(prompt=[5, -1]), "prompt", ""),
    ("token id 2**63", CMPL, cmpl(prompt=[2 ** 63]), "prompt", ""),
    ("token id in second prompt", CMPL, cmpl(prompt=[[5], [VOCAB + 100]]), "prompt", str(VOCAB)),
    ("empty text prompt", CMPL, cmpl(prompt=""), "prompt", "empty"),
    ("empty prompt list", CMPL, cmpl(prompt=[]), "prompt", "empty"),
    ("empty token prompt", CMPL, cmpl(prompt=[[]]), "prompt", "empty"),
    ("an empty prompt among others", CMPL, cmpl(prompt=["a", ""]), "prompt", "empty"),
    ("too many prompts", CMPL, cmpl(prompt=["a"] * (MAX_PROMPTS_PER_REQUEST + 1)), "prompt", ""),
    ("too many token prompts", CMPL, cmpl(prompt=[[5]] * (MAX_PROMPTS_PER_REQUEST + 1)), "prompt", ""),
    ("prompts x n too many", CMPL, cmpl(prompt=["a"] * 9, n=MAX_N), "n", ""),
    ("text prompt too long", CMPL, cmpl(prompt="a" * (MAX_CHARS + 1)), "prompt", str(MAX_CHARS)),
    ("token prompt too long", CMPL, cmpl(prompt=[5] * MAX_MODEL_LEN), "prompt", str(MAX_MODEL_LEN)),
    ("prompt of wrong type", CMPL, cmpl(prompt={"text": "x"}), "prompt", ""),
    ("prompt null", CMPL, cmpl(prompt=None), "prompt", ""),
    # -- a lone UTF-16 surrogate (JSON "\ud800") is not Unicode text: the tokenizer raised TypeError, a 500
    ("lone surrogate prompt", CMPL, cmpl(prompt="a\ud800"), "prompt", "surrogate"),
    ("lone surrogate in a prompt list", CMPL, cmpl(prompt=["fine", "b\udfff"]), "prompt", "surrogate"),
    ("lone surrogate content", CHAT, chat(messages=[{"role": "user", "content": "a\ud800"}]), "messages",
     "surrogate"),
    ("lone surrogate text part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]), "messages", "surrogate"),
    # -- a boolean is not a number, a string is not an integer
    ("bool token id", CMPL, cmpl(prompt=[[False]]), "prompt", ""),
    ("bool token ids", CMPL, cmpl(prompt=[True, 5]), "prompt", ""),
    ("n true", CMPL, cmpl(n=True), "n", ""),
    ("max_tokens string", CMPL, cmpl(max_tokens="5"), "max_tokens", ""),
    ("max_tokens true", CHAT, chat(max_tokens=True), "max_tokens", ""),
    ("temperature true", CMPL, cmpl(temperature=True), "temperature", ""),
    ("seed false", CMPL, cmpl(seed=False), "seed", ""),
    ("stop_token_ids bool", CMPL, cmpl(stop_token_ids=[True]), "stop_token_ids", ""),
    ("chat logprobs as int", CHAT, chat(logprobs=1), "logprobs", ""),
    ("stream as string", CMPL, cmpl(stream="yes"), "stream", ""),
    ("model as number", CMPL, cmpl(model=5), "model", ""),
    # -- stop lists
    ("too many stop strings", CMPL, cmpl(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", ""),
    ("stop string too long", CMPL, cmpl(stop="x" * (MAX_STOP_STRING_CHARS + 1)), "stop", ""),
    ("empty stop string", CMPL, cmpl(stop=[""]), "stop", ""),
    ("too many stop token ids", CMPL, cmpl(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids", ""),
    # -- chat messages
    ("empty messages", CHAT, chat(messages=[]), "messages", "empty"),
    ("unknown role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), "messages", "robot"),
    ("tool message field on a user", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_call_id": 1}]),
     "messages", "tool_call_id"),
    # -- images to this text-only model: refused by name before anything is fetched or decoded
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages", "takes text only"),
    ("undecodable image", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}]), "messages", "takes text only"),
    ("image part without url", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"detail": "low"}}]}]), "messages", "url"),
    ("tokenize an image", "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages",
     "takes text only"),
    ("audio part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "input_audio", "input_audio": {}}]}]), "messages", "input_audio"),
    ("text part without text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages", ""),
    ("content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages", ""),
    ("message without role", CHAT, chat(messages=[{"content": "x"}]), "messages", "role"),
    ("assistant tool_calls", CHAT, chat(messages=[*USER, {"role": "assistant", "content": None,
                                                          "tool_calls": [{"id": "1"}]}]), "messages", "tool_calls"),
    ("too many messages", CHAT, chat(messages=USER * (MAX_MESSAGES + 1)), "messages", ""),
    ("messages too long in total", CHAT, chat(messages=[{"role": "user", "content": "a" * (MAX_CHARS // 2 + 1)}] * 2),
     "messages", str(MAX_CHARS)),
    # -- unimplemented OpenAI and vLLM fields with a value that would matter, and bad values of
    # the fields pagoda implements or ignores
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "tools"),
    ("tool_choice auto", CHAT, chat(tool_choice="auto"), "tool_choice", "tool_choice"),
    ("tool_choice required", CHAT, chat(tool_choice="required"), "tool_choice", "tool_choice"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), "functions", "functions"),
    ("function_call", CHAT, chat(function_call="auto"), "function_call", "function_call"),
    ("response_format unknown type", CHAT, chat(response_format={"type": "xml"}), "response_format",
     "response_format"),
    ("response_format schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "response_format"),
    ("store not a bool", CHAT, chat(store="yes"), "store", "store"),
    ("audio output", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "audio", "text only"),
    ("audio modality", CHAT, chat(modalities=["text", "audio"]), "modalities", "text only"),
    ("metadata not strings", CHAT, chat(metadata={"a": 1}), "metadata", ""),
    ("reasoning_effort unknown", CHAT, chat(reasoning_effort="extreme"), "reasoning_effort", ""),
    ("chat_template_kwargs a list", CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs", ""),
    ("chat_template_kwargs sets a template argument", CHAT, chat(chat_template_kwargs={"tools": []}),
     "chat_template_kwargs", "tools"),
    ("request chat template", CHAT, chat(chat_template="{{ 1 }}"), "chat_template", "chat_template"),
    ("continue and generation prompt", CHAT, chat(continue_final_message=True), "continue_final_message",
     "add_generation_prompt"),
    ("documents not objects", CHAT, chat(documents=["x"]), "documents", ""),
    ("echo a string", CHAT, chat(echo="yes"), "echo", ""),
    ("beam search", CMPL, cmpl(use_beam_search=True), "use_beam_search", "use_beam_search"),
    ("priority", CHAT, chat(priority=1), "priority", "priority"),
    ("length_penalty", CMPL, cmpl(length_penalty=2.0), "length_penalty", "length_penalty"),
    ("logits_processors", CMPL, cmpl(logits_processors=["x"]), "logits_processors", "logits_processors"),
    ("prompt_embeds", CMPL, cmpl(prompt_embeds="AAAA"), "prompt_embeds", "prompt_embeds"),
    ("return_token_ids", CHAT, chat(return_token_ids=True), "return_token_ids", "return_token_ids"),
    ("spaces_between_special_tokens", CMPL, cmpl(spaces_between_special_tokens=False),
     "spaces_between_special_tokens", "true"),
    ("guided_json not a schema", CMPL, cmpl(guided_json=5), "guided_json", ""),
    ("guided_choice empty", CHAT, chat(guided_choice=[]), "guided_choice", "choice"),
    ("two guided fields", CMPL, cmpl(guided_regex="a", guided_grammar="b"), "guided_regex", "guided_grammar"),
    ("continuous_usage_stats a string", CMPL, cmpl(stream=True, stream_options={"include_usage": True,
                                                                                 "continuous_usage_stats": "y"}),
     "stream_options", "continuous_usage_stats"),
    ("best_of 3", CMPL, cmpl(best_of=3), "best_of", "best_of"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), "stream_options",
     "stream: true"),
    ("stream_options with stream false", CMPL, cmpl(stream=False, stream_options={"include_usage": True}),
     "stream_options", "stream: true"),
    ("logit_bias above 100", CMPL, cmpl(logit_bias={"5": 100.5}), "logit_bias", "100"),
    ("chat logit_bias below -100", CHAT, chat(logit_bias={"5": -101}), "logit_bias", "100"),
    ("logit_bias key not an id", CMPL, cmpl(logit_bias={"a5": 1}), "logit_bias", "a5"),
    ("logit_bias id past vocab", CMPL, cmpl(logit_bias={str(VOCAB): 1}), "logit_bias", str(VOCAB)),
    ("chat logit_bias id past vocab", CHAT, chat(logit_bias={str(VOCAB): 1}), "logit_bias", str(VOCAB)),
    ("logit_bias NaN", CMPL, raw('{"prompt": "x", "logit_bias": {"5": NaN}}'), "logit_bias", ""),
    ("prompt_logprobs past max", CMPL, cmpl(prompt_logprobs=21), "prompt_logprobs", "20"),
    ("chat prompt_logprobs negative", CHAT, chat(prompt_logprobs=-1), "prompt_logprobs", ""),
    ("prompt_logprobs streamed", CMPL, cmpl(prompt_logprobs=1, stream=True), "prompt_logprobs", "stream"),
    ("max_tokens 0 without echo", CMPL, cmpl(max_tokens=0), "max_tokens", "echo"),
    ("suffix", CMPL, cmpl(suffix="tail"), "suffix", "suffix"),
    # A union's member that fits the input's type names the problem (not another member's type).
    ("129 text prompts", CMPL, cmpl(prompt=["hello"] * 129), "prompt", "at most 128 items"),
    ("a negative prompt token", CMPL, cmpl(prompt=[-1]), "prompt", "greater than or equal to 0"),
    ("1025 response input items", "/v1/responses", {"model": MODEL, "input": [
        {"role": "user", "content": "x"}] * 1025}, "input", "at most 1024 items"),
    ("max_output_tokens past the context", "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 10**6},
     "max_output_tokens", "lower max_output_tokens to at most"),  # the request's own field name throughout
    # -- tokenize and detokenize
    ("tokenize too long", "/tokenize", {"prompt": "a" * (MAX_CHARS + 1)}, "prompt", str(MAX_CHARS)),
    ("tokenize unknown role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "robot"),
    ("tokenize lone surrogate", "/tokenize", {"prompt": "a\ud800"}, "prompt", "surrogate"),
    ("tokenize messages lone surrogate", "/tokenize", {"messages": [{"role": "user", "content": "a\ud800"}]},
     "messages", "surrogate"),
    ("tokenize tools of wrong type", "/tokenize", {"messages": USER, "tools": [{"type": "web"}]}, "tools", ""),
    ("detokenize past vocab", "/detokenize", {"tokens": [VOCAB]}, "tokens", str(VOCAB)),
    ("detokenize bool", "/detokenize", {"tokens": [True]}, "tokens", ""),
    ("detokenize 2**64", "/detokenize", {"tokens": [2 ** 64]}, "tokens", ""),
    # -- not JSON, not an object, not JSON's content type
    ("invalid JSON", CMPL, raw('{"prompt": "x",'), None, "JSON"),
    ("JSON array", CMPL, raw("[1, 2]"), None, "object"),
    ("JSON NaN body", CMPL, raw("NaN"), None, ""),
    ("empty body", CMPL, raw(""), None, ""),
    ("deeply nested JSON", CMPL, raw("[" * 100_000 + "]" * 100_000), None, ""),
    ("not UTF-8", CMPL, b'{"prompt": "\xff\xfe"}', None, ""),
]


def post(server: ServerProcess, path: str, body: dict | bytes, content_type: str = "application/json"
         ) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers={"content-type": content_type}, timeout=60)


def assert_openai_error(resp: httpx.Response, param: str | None) -> dict[str, Any]:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error


def assert_still_serving(server: ServerProcess) -> None:
    resp = post(server, CMPL, {"model": MODEL, "prompt": "Still there?", "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("name,path,body,param,needle", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_request_is_refused_and_server_keeps_serving(server: ServerProcess, first_engine_pid: int,
                                                             name: str, path: str, body: dict | bytes,
                                                             param: str | None, needle: str) -> None:
    resp = post(server, path, body)
    assert resp.status_code == 400, (resp.status_code, resp.text[:500])
    error = assert_openai_error(resp, param)
    assert needle in error["message"], error
    assert "Traceback" not in error["message"]
    assert_still_serving(server)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_wrong_content_type_is_400(server: ServerProcess, content_type: str) -> None:
    resp = post(server, CMPL, cmpl(), content_type=content_type)
    assert resp.status_code == 400, resp.text
    assert_openai_error(resp, None)
    assert_still_serving(server)


@pytest.mark.parametrize("path,body", [
    (CHAT, chat(response_format={"type": "text"}, tools=[], tool_choice="none", functions=None, function_call=None,
                parallel_tool_calls=False, store=False, logit_bias={}, user="u-1", stream_options=None,
                model=MODEL)),
    (CHAT, chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "x"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None},
                          {"role": "user", "content": "more", "name": "bob"}])),
    (CMPL, cmpl(best_of=2, n=2, logit_bias={}, suffix="", user="u-1", echo=False, seed=SEED_MIN,
                stream_options={})),  # an empty stream_options without a stream passes, as in vLLM
    (CMPL, cmpl(seed=SEED_MAX, top_k=VOCAB, top_p=1e-300, min_p=1.0, temperature=100, repetition_penalty=0.01)),
    (CMPL, cmpl(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=[VOCAB - 1] * MAX_STOP_TOKEN_IDS, logprobs=20)),
])
def test_no_op_values_and_extremes_are_accepted(server: ServerProcess, path: str, body: dict) -> None:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text


# Fields no model declares: ignored, with a warning in the server log naming them.
UNKNOWN: list[tuple[str, dict, str]] = [
    (CMPL, cmpl(frobnicate_a=1), "'frobnicate_a'"),
    (CHAT, chat(frobnicate_b=1), "'frobnicate_b'"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "audio": {"id": "1"}}]), "'messages[0].audio'"),
    (CMPL, cmpl(stream=True, stream_options={"include_usage": True, "frobnicate_c": 1}),
     "'stream_options.frobnicate_c'"),
    ("/tokenize", {"prompt": "x", "frobnicate_d": 1}, "'frobnicate_d'"),
    (CMPL, cmpl(tools=[{"type": "function", "function": {"name": "f"}}]), "'tools'"),  # a chat field
]


@pytest.mark.parametrize("path,body,named", UNKNOWN, ids=[c[2] for c in UNKNOWN])
def test_unknown_fields_are_ignored_with_a_warning(server: ServerProcess, path: str, body: dict,
                                                   named: str) -> None:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    assert any("ignored request fields" in line and named in line for line in server.log().splitlines())


def test_openai_client_ordinary_calls_pass(client: openai.OpenAI) -> None:
    """The official client sends only what it is given: none of it is refused."""
    out = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, temperature=0.7, top_p=0.9, n=2,
                                    stop=["\n\n"], seed=5, logprobs=2, echo=False, presence_penalty=0.1,
                                    frequency_penalty=0.1, user="me", best_of=2, logit_bias={}, suffix=None)
    assert len(out.choices) == 4
    chunks = list(client.completions.create(model=MODEL, prompt="a", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
        max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=2, n=1, seed=1, stop="\n",
        response_format={"type": "text"}, user="me", parallel_tool_calls=False)
    assert reply.choices[0].message.role == "assistant"
    follow_up = client.chat.completions.create(
        model=MODEL, max_tokens=2,
        messages=[{"role": "user", "content": "y"}, reply.choices[0].message.model_dump(exclude_unset=True),
                  {"role": "user", "content": "z"}])
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}])
    assert err.value.body["param"] == "tools"


def test_openai_client_image_to_a_text_only_model_is_400_and_others_run(client: openai.OpenAI) -> None:
    """The official client's image_url request gets a 400 naming the problem, while a text
    request streamed at the same time runs to its end untouched."""
    image = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the text request is in the engine
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": image, "detail": "low"}}]}])
    assert err.value.status_code == 400 and err.value.body["param"] == "messages"
    assert "takes text only" in err.value.body["message"] and "image" in err.value.body["message"]
    rest = list(stream)
    assert first.choices[0].delta.role == "assistant"
    assert rest[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].delta.content or "" for c in rest if c.choices)) > 0


# The third: characters of several bytes, which the tokenizer may split over tokens (each such
# token's text is U+FFFD): text_offset must still only grow, prompt and completion alike.
@pytest.mark.parametrize("prompt", ["Hello there my", [[5, 6, 7]], "h\u00e9llo \u65e5\u672c"])
def test_echo_with_logprobs_prompt_first(client: openai.OpenAI, prompt: Any) -> None:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice, n_prompt = full.choices[0], full.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(top and len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    prompt_tokens = "".join(lp.tokens[:n_prompt])
    if "\ufffd" not in prompt_tokens:  # whole characters: the token texts spell the prompt
        assert prompt_tokens == choice.text[:len(prompt_tokens)]
    plain = client.completions.create(**{**kw, "echo": False})
    assert lp.tokens[n_prompt:] == plain.choices[0].logprobs.tokens  # the completion's come after
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs)
    stream = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    streamed = {k: [x for c in stream for x in getattr(c.choices[0].logprobs, k)]
                for k in ("tokens", "token_logprobs", "text_offset")}
    assert "".join(c.choices[0].text for c in stream) == choice.text
    assert streamed["tokens"] == lp.tokens
    assert streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:])


def test_openapi_documents_real_statuses(server: ServerProcess) -> None:
    doc = httpx.get(server.base_url + "/openapi.json").json()
    assert "Duplicate Operation ID" not in server.log()  # one operation id per route and method
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            assert "500" in op["responses"], (method, path)
            # Anthropic's Messages API answers errors in Anthropic's shape.
            error = "MessagesErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
            for status, response in op["responses"].items():
                if status[0] in "45":
                    assert response["content"] == {"application/json": {"schema": {
                        "$ref": f"#/components/schemas/{error}"}}}, (method, path, status)
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "500", "503"} <= set(completions)
    assert "401" not in completions  # no --api-key here
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    seed = next(s for s in schemas["CompletionRequest"]["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
    assert (seed["minimum"], seed["maximum"]) == (SEED_MIN, SEED_MAX)  # exact, not rounded through a float
    # Other properties are admitted (ignored with a warning; refused with --strict-request-fields).
    assert schemas["CompletionRequest"]["additionalProperties"] is True


def test_model_list_and_unknown_model_show_no_server_path(server: ServerProcess, llama_dir: Path) -> None:
    """``root`` was the model's directory on the server: a client learns only served names."""
    listed = httpx.get(server.base_url + "/v1/models", timeout=30)
    assert [(m["id"], m["root"]) for m in listed.json()["data"]] == [(MODEL, MODEL)]
    missing = post(server, CMPL, cmpl(model="gpt-9"))
    assert missing.status_code == 404
    for resp in (listed, missing):
        assert str(llama_dir) not in resp.text and llama_dir.name not in resp.text


def test_engine_core_survived_everything(server: ServerProcess, first_engine_pid: int) -> None:
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert health.status_code == 200
    assert health.json()["engine_pid"] == first_engine_pid


def test_500_handler_and_failure_never_return_exception_text() -> None:
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagoda.engine.core_client import RequestFailedError
    from pagoda.entrypoints.openai.server import _add_error_handlers
    from pagoda.entrypoints.openai.serving_common import failure

    app = FastAPI()
    statuses: list[int] = []
    _add_error_handlers(app, SimpleNamespace(metrics=SimpleNamespace(on_http_error=statuses.append)))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret path /etc/shadow in a traceback")

    resp = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert resp.status_code == 500 and statuses == [500]
    assert "secret" not in resp.text and "RuntimeError" not in resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    for exc in (RuntimeError("secret"), KeyError("secret"), RequestFailedError("secret")):
        error = failure(exc)
        assert error.status == 500 and "secret" not in error.message
