"""Client libraries no one here wrote, pointed at ``pagoda serve``: LangChain's ``ChatOpenAI`` and
litellm, for plain chat, streaming, structured output (a pydantic model through json_schema) and
forced tool calls. The checkpoint has random weights, so the schemas are closed (enums, booleans):
constrained decoding makes every answer valid, and the libraries must parse it into their own
objects. And guidellm's default streaming benchmark, which must finish without one error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from server_helpers import ServerProcess

MODEL = "tiny"
QUESTION = "What is the weather in Paris?"


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server  # tests/entrypoints/conftest.py: shared with the other request-only modules


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy_chat(client: openai.OpenAI, **kw) -> str:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                         temperature=0, max_tokens=8, **kw)
    return out.choices[0].message.content or ""


# ---- LangChain ---------------------------------------------------------------------------------

def _langchain(server: ServerProcess, **kw):
    from langchain_openai import ChatOpenAI  # in the test extra

    return ChatOpenAI(model=MODEL, base_url=server.base_url + "/v1", api_key="x", temperature=0,
                      max_retries=0, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(server: ServerProcess, method: str) -> None:
    llm = _langchain(server, max_tokens=64).with_structured_output(Weather, method=method)
    answer = llm.invoke(QUESTION)
    assert isinstance(answer, Weather)
    batch = llm.batch([QUESTION, "And in Rome?"])
    assert all(isinstance(a, Weather) for a in batch) and batch[0] == answer  # greedy: same question, same answer


def test_langchain_forced_tool_call(server: ServerProcess) -> None:
    llm = _langchain(server, max_tokens=64).bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    message = llm.invoke(QUESTION)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    assert call["args"]["city"] in ("Paris", "Rome") and isinstance(call["args"]["celsius"], bool)
    assert not message.invalid_tool_calls


def test_langchain_plain_and_streamed(server: ServerProcess, client: openai.OpenAI) -> None:
    llm = _langchain(server, max_tokens=8)
    text = llm.invoke(QUESTION).text
    assert text == _greedy_chat(client)
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == text


# ---- litellm -----------------------------------------------------------------------------------

def _litellm(server: ServerProcess, **kw):
    import litellm  # in the test extra

    return litellm.completion(model=f"openai/{MODEL}", api_base=server.base_url + "/v1", api_key="x",
                              messages=[{"role": "user", "content": QUESTION}], temperature=0, **kw)


def test_litellm_plain_structured_and_tools(server: ServerProcess, client: openai.OpenAI) -> None:
    plain = _litellm(server, max_tokens=8)
    assert plain.choices[0].message.content == _greedy_chat(client)
    assert plain.usage.completion_tokens == 8 or plain.choices[0].finish_reason == "stop"

    structured = _litellm(server, max_tokens=64, response_format=Weather)
    Weather.model_validate_json(structured.choices[0].message.content)

    tools = _litellm(server, max_tokens=64, tools=[WEATHER_TOOL],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = tools.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool)

    chunks = list(_litellm(server, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _greedy_chat(client)


# ---- guidellm ----------------------------------------------------------------------------------

def test_guidellm_default_streaming_run_has_no_errors(server: ServerProcess, llama_dir: Path, tmp_path: Path) -> None:
    """guidellm's default backend streams chat completions with continuous usage stats; four
    concurrent streams of synthetic prompts, every request counted as successful with the
    output length it asked for."""
    report = tmp_path / "guidellm.json"
    done = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={server.base_url}",
         "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=12",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--tokenizer", f"kind=huggingface_auto,model={llama_dir}", "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] >= 12, totals
    output = bench["metrics"]["output_token_count"]["successful"]
    assert output["min"] == output["max"] == 16, output
