"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``): they find the calls a
model wrote in its own format. ``scan(text, final)`` returns how much of ``text`` is safely
plain content (a prefix that can no longer turn into a call) and the calls complete so far, as
``(name, arguments JSON)``; both only grow as text arrives, so streaming (``ToolStreamer``) and
the whole-text answer agree. ``resolve_tool_parser`` picks the parser a server uses (by name, or
``auto``: from the chat template)."""
from __future__ import annotations

import re

from pagoda.entrypoints.openai.tool_parsers.base import Call, ToolParser
from pagoda.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagoda.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagoda.entrypoints.openai.tool_parsers.openai import OpenAIToolParser
from pagoda.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagoda.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
    "deepseek_v3": DeepSeekV3ToolParser, "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser,
    "openai": OpenAIToolParser}


# Marks in a chat template of the call format its model writes, in the order they are tried (a
# template that shows both writes hermes blocks around JSON calls; harmony's recipient first).
TEMPLATE_MARKS = (("<|call|>", "openai"), ("to=functions.", "openai"),
                  ("<｜tool▁calls▁begin｜>", "deepseek_v3"), ("[TOOL_CALLS]", "mistral"),
                  ("<function=", "qwen3_coder"), ("<tool_call>", "hermes"), ("<|python_start|>", "pythonic"),
                  ("<|python_tag|>", "llama3_json"))


def detect_tool_parser(chat_template: str | dict | None) -> str | None:
    """The parser for the call format the chat template shows its model (``--tool-call-parser
    auto``): None when the template does not use ``tools`` or writes no known call format."""
    if isinstance(chat_template, dict):  # named templates: the default one decides
        chat_template = chat_template.get("default") or chat_template.get("tool_use")
    if not isinstance(chat_template, str) or not re.search(r"\btools\b", chat_template):
        return None
    return next((parser for mark, parser in TEMPLATE_MARKS if mark in chat_template), None)


def resolve_tool_parser(flag: str | None, enabled: bool, chat_template: str | dict | None) -> str | None:
    """The parser for ``tool_choice: "auto"`` (None: "auto" is refused). ``flag`` is
    ``--tool-call-parser`` (a name, ``auto`` or ``none``; unset is ``auto``); ``enabled`` is
    ``--enable-auto-tool-choice``, which needs a parser (``ValueError`` if ``auto`` finds none).
    Without it, ``auto`` turns tool choice on when the template shows a known call format, and a
    named parser is used as given."""
    flag = flag or "auto"
    if flag == "none":
        if enabled:
            raise ValueError("--enable-auto-tool-choice needs a --tool-call-parser, not none")
        return None
    if flag != "auto":
        get_tool_parser(flag)  # an unknown name is an error
        return flag
    found = detect_tool_parser(chat_template)
    if found is None and enabled:
        raise ValueError("--enable-auto-tool-choice: the chat template shows no tool-call format pagoda knows; "
                         f"name one with --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})")
    return found


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; pagoda has {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["Call", "ToolParser", "TOOL_PARSERS", "detect_tool_parser", "get_tool_parser", "resolve_tool_parser"]
