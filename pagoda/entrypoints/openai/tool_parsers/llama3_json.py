"""Llama 3.x JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}`` (several
separated by ``;``), optionally after ``<|python_tag|>``."""
from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import ToolParser
from pagoda.entrypoints.openai.tool_parsers.partial import (PartialCall, complete_call, partial_call, scan_object,
                                                            skip_ws, value_end)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return 0, []  # maybe the tag, maybe not yet: wait
        if i >= len(text) or text[i] != "{":
            return (len(text) if (final or i < len(text)) else 0), []
        calls: list[PartialCall] = []
        while True:
            i = skip_ws(text, i, ";")
            if i >= len(text):
                break
            end = value_end(text, i) if text[i] == "{" else None
            if end is None:
                if final or text[i] != "{":
                    return (len(text), []) if final else (0, calls)  # not calls after all
                call = partial_call(text, scan_object(text, i))  # being written
                if call is not None:
                    calls.append(call)
                break
            whole = complete_call(text, i, end)
            if whole is None:
                return (len(text), []) if final else (0, calls)
            calls.append(PartialCall(*whole, True))
            i = end
        if final and not calls:
            return len(text), []
        return 0, calls
