"""Llama 3.x JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}`` (several
separated by ``;``), optionally after ``<|python_tag|>``."""
from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import Call, ToolParser, call_of, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> tuple[int, list[Call]]:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif not final and PYTHON_TAG.startswith(body):
            return 0, []  # maybe the tag, maybe not yet: wait
        if not body.startswith("{"):
            return (len(text) if (final or body) else 0), []
        if not final:
            return 0, []  # a call being written: it is parsed whole at the end
        values = json_values(body, ";")
        calls = [call_of(v) for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return len(text), []
        return 0, [c for c in calls if c is not None]
