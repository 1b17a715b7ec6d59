"""The parser interface and JSON helpers shared by the parsers."""
from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall

Call = tuple[str, str]  # (function name, arguments as JSON text)


class ToolParser:
    name = ""
    # True: calls are written with special tokens (harmony), read from the output decoded with
    # them kept and handed on by the reasoning parser's split (``streamer(tool_calls=True)``).
    reads_special_tokens = False

    def __init__(self) -> None:
        # The request's OpenAI tool dicts, for formats whose values are typed by the schemas.
        self.tools: list[dict[str, Any]] = []

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        """(length of the plain-content prefix, calls) of the output so far: complete calls,
        then maybe the one being written (its name and a prefix of its arguments, for
        streaming). Both only grow as text arrives."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> tuple[int, list[Call]]:
        """(length of the plain-content prefix, complete calls) of the output so far."""
        end, calls = self.scan_partial(text, final)
        return end, [(c.name, c.arguments) for c in calls if c.complete]  # type: ignore[misc]


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
