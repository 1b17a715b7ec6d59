"""Qwen3-Coder: XML calls, ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function>
</tool_call>``. A value is the text between its tags (one newline either side dropped); it is
read as JSON when the function's schema gives the parameter a type other than string, and kept
as a string otherwise (or when it does not parse). The arguments JSON grows one parameter at a
time, so a stream sends each as soon as its ``</parameter>`` is written."""
from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import ToolParser, partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        start = text.find(OPEN)
        if start < 0:
            return (len(text) if final else len(text) - partial_suffix(text, OPEN)), []
        calls: list[PartialCall] = []
        at = start
        while (begin := text.find(OPEN, at)) >= 0:
            end = text.find(CLOSE, begin)
            body = text[begin + len(OPEN):end if end >= 0 else len(text)]
            call = self._call(body, done=end >= 0 or final)
            if call is not None and (call.complete or not final):
                calls.append(call)
            if end < 0:
                break
            at = end + len(CLOSE)
        if final and not calls:
            return len(text), []  # no parsable call after all: everything was content
        return start, calls

    def _call(self, body: str, done: bool) -> PartialCall | None:
        """The call in one block's body (``done``: the block is closed or the output ended)."""
        f = body.find(FUNCTION)
        name_end = body.find(">", f) if f >= 0 else -1
        if f < 0 or name_end < 0 or body[:f].strip():
            return None
        name = body[f + len(FUNCTION):name_end].strip()
        types = self._types(name)
        parts, i = [], name_end + 1
        while (p := body.find(PARAM, i)) >= 0:
            key_end = body.find(">", p)
            close = body.find(PARAM_END, key_end) if key_end >= 0 else -1
            if close < 0:
                break
            key = body[p + len(PARAM):key_end].strip()
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(_value(body[key_end + 1:close], types.get(key)), ensure_ascii=False)}")
            i = close + len(PARAM_END)
        closed = body.find(FUNCTION_END, i) >= 0
        args = "{" + ", ".join(parts)
        if closed or (done and body.find(PARAM, i) < 0):
            return PartialCall(name, args + "}", True) if name else None
        return PartialCall(name, args, False) if name and not done else None

    def _types(self, name: str) -> dict[str, Any]:
        """The declared JSON type of each parameter of function ``name`` (from the request's tools)."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                props = (function.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def _value(raw: str, kind: Any) -> Any:
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
