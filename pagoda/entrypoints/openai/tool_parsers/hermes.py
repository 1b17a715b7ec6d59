"""Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""
from __future__ import annotations

import json

from pagoda.entrypoints.openai.tool_parsers.base import Call, ToolParser, call_of, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> tuple[int, list[Call]]:
        start = text.find(OPEN)
        if start < 0:
            return (len(text) if final else len(text) - partial_suffix(text, OPEN)), []
        calls: list[Call] = []
        at = start
        while True:
            begin = text.find(OPEN, at)
            if begin < 0:
                break
            end = text.find(CLOSE, begin)
            body = text[begin + len(OPEN):end if end >= 0 else len(text)]
            if end < 0 and not final:
                break  # still being written
            call = _parse(body)
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            at = end + len(CLOSE)
        if final and not calls:
            return len(text), []  # no parsable call after all: everything was content
        return start, calls


def _parse(body: str) -> Call | None:
    try:
        return call_of(json.loads(body.strip()))
    except ValueError:
        return None
