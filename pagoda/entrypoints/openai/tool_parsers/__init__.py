"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``): they find the calls a
model wrote in its own format. ``scan(text, final)`` returns how much of ``text`` is safely
plain content (a prefix that can no longer turn into a call) and the calls complete so far, as
``(name, arguments JSON)``; both only grow as text arrives, so streaming (``ToolStreamer``) and
the whole-text answer agree."""
from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import Call, ToolParser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; pagoda has {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["Call", "ToolParser", "TOOL_PARSERS", "get_tool_parser"]
