"""The parser interface and JSON helpers shared by the parsers."""
from __future__ import annotations

import json
from typing import Any

Call = tuple[str, str]  # (function name, arguments as JSON text)


class ToolParser:
    name = ""

    def scan(self, text: str, final: bool) -> tuple[int, list[Call]]:
        """(length of the plain-content prefix, complete calls) of the output so far."""
        raise NotImplementedError


def call_of(obj: Any) -> Call | None:
    """A call from ``{"name": ..., "arguments" | "parameters": {...}}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """Every JSON value in ``text``, separated by whitespace and ``separators``; None if
    something else is there."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
