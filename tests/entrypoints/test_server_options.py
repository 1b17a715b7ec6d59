"""``api_server_options``: the serve flags that shape the OpenAI layer, read the same way by the
single server and by every Ray replica (which builds its ``APIServer`` from them too)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from pagoda.entrypoints.openai.server import add_serve_args, api_server_options
from pagoda.tools.make_model import build_tokenizer


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["model", *argv])


@pytest.fixture(scope="module")
def engine() -> SimpleNamespace:
    tok = build_tokenizer(512)
    tok.add_tokens(["<think>", "</think>"])
    return SimpleNamespace(tokenizer=tok)


def test_parsers_and_limits_come_from_the_flags(engine: SimpleNamespace) -> None:
    options = api_server_options(serve_args("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                            "--max-stored-responses", "7", "--strict-request-fields",
                                            "--no-strict-tool-arguments"), engine)
    assert type(options["reasoning_parser"]).__name__.lower().startswith("qwen3")
    assert options["tool_call_parser"] == "hermes"
    assert options["max_stored_responses"] == 7
    assert options["strict_request_fields"] is True and options["strict_tool_arguments"] is False


def test_harmony_tool_parser_brings_its_reasoning_split() -> None:
    from tokenizers import AddedToken

    tok = build_tokenizer(512)
    tok.add_tokens([AddedToken(t, special=True) for t in ("<|channel|>", "<|message|>", "<|end|>", "<think>",
                                                           "</think>")], special_tokens=True)
    engine = SimpleNamespace(tokenizer=tok)
    options = api_server_options(serve_args("--tool-call-parser", "openai"), engine)
    assert options["tool_call_parser"] == "openai" and options["reasoning_parser"].name == "openai_gptoss"
    with pytest.raises(ValueError, match="openai_gptoss"):
        api_server_options(serve_args("--tool-call-parser", "openai", "--reasoning-parser", "qwen3"), engine)


def test_defaults_and_a_parser_the_tokenizer_cannot_serve(engine: SimpleNamespace) -> None:
    options = api_server_options(serve_args(), engine)
    assert options["reasoning_parser"] is None and options["strict_tool_arguments"] is True
    no_tags = SimpleNamespace(tokenizer=build_tokenizer(512))  # <think> is not one token here
    with pytest.raises(ValueError):
        api_server_options(serve_args("--reasoning-parser", "qwen3"), no_tags)
