"""Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""
from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import ToolParser, partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial import (PartialCall, complete_call, partial_call, scan_object,
                                                            skip_ws, value_end)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        start = text.find(OPEN)
        if start < 0:
            return (len(text) if final else len(text) - partial_suffix(text, OPEN)), []
        calls: list[PartialCall] = []
        at = start
        while True:
            begin = text.find(OPEN, at)
            if begin < 0:
                break
            end = text.find(CLOSE, begin)
            body_start, body_end = begin + len(OPEN), (end if end >= 0 else len(text))
            if end < 0 and not final:  # still being written: what of it can be sent
                i = skip_ws(text, body_start)
                if i < len(text) and text[i] == "{":
                    call = partial_call(text, scan_object(text, i))
                    if call is not None:
                        calls.append(call)
                break
            whole = _complete(text, body_start, body_end)
            if whole is not None:
                calls.append(PartialCall(*whole, True))
            if end < 0:
                break
            at = end + len(CLOSE)
        if final and not calls:
            return len(text), []  # no parsable call after all: everything was content
        return start, calls


def _complete(text: str, start: int, end: int) -> tuple[str, str] | None:
    """The call in the block body ``text[start:end]`` (one JSON object, whitespace around)."""
    i = skip_ws(text, start)
    if i >= end or text[i] != "{":
        return None
    obj_end = value_end(text[:end], i)
    if obj_end is None or text[obj_end:end].strip():
        return None
    return complete_call(text, i, obj_end)
