"""Pythonic calls (Llama 3.2 / 4): the reply is a Python list of calls with keyword arguments,
``[get_weather(city="Paris"), add(a=1, b=2)]``, optionally inside ``<|python_start|>`` …
``<|python_end|>``. Each argument is read with ``ast`` (``literal_eval``: literals only, nothing
is evaluated), and the arguments JSON grows one argument at a time, so a stream sends each as
soon as the comma or ``)`` after it is written (the call itself once its first argument reads).
As with every parser, text after a list that looked like calls makes the whole reply content,
though a stream has sent the calls by then."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import ToolParser
from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall, skip_ws

START = "<|python_start|>"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_BAD = object()


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        i = skip_ws(text, 0)
        if text.startswith(START, i):
            i = skip_ws(text, i + len(START))
        elif not final and START.startswith(text[i:]) and text[i:]:
            return 0, []  # maybe the tag, maybe not yet: wait
        if i >= len(text) or text[i] != "[":
            return (len(text) if (final or i < len(text)) else 0), []
        calls, ok = _calls(text, i + 1, final)
        if final and (not ok or not calls):
            return len(text), []  # not a list of calls after all: everything was content
        if not ok:
            return len(text), []
        return 0, calls


def _calls(text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
    """The calls of the list whose ``[`` ends before ``text[i]``, and whether all of it reads as
    calls so far (and, when ``final``, the list closed)."""
    calls: list[PartialCall] = []
    while True:
        i = skip_ws(text, i, ",")
        if i >= len(text):
            return calls, not final
        if text[i] == "]":
            return calls, text[i + 1:].strip() in ("", "<|python_end|>")
        m = NAME.match(text, i)
        if m is None or (m.end() < len(text) and text[m.end()] != "("):
            return calls, False
        if m.end() >= len(text):
            return calls, not final
        call, end, ok = _call(text, m.group(), m.end() + 1)
        if not ok:
            return calls, False
        if call is not None and (call.complete or not final):
            calls.append(call)
        if end is None:
            return calls, not final
        i = end


def _call(text: str, name: str, i: int) -> tuple[PartialCall | None, int | None, bool]:
    """The call whose ``(`` ends before ``text[i]``: (the call so far, just past its ``)`` or None
    while open, whether its arguments read)."""
    parts: list[str] = []
    while True:
        end = _arg_end(text, i)
        if end is None:  # an argument still being written; the call is sent once one has read
            return (PartialCall(name, "{" + ", ".join(parts), False) if parts else None), None, True
        segment = text[i:end].strip()
        if segment:
            arg = _keyword(segment)
            if arg is None:
                return None, None, False
            parts.append(f"{json.dumps(arg[0])}: {json.dumps(arg[1], ensure_ascii=False)}")
        if text[end] == ")":
            return PartialCall(name, "{" + ", ".join(parts) + "}", True), end + 1, True
        i = end + 1


def _arg_end(text: str, i: int) -> int | None:
    """Index of the ``,`` or ``)`` that ends the argument starting at ``text[i]``, outside
    brackets and strings; None if not written yet."""
    depth, quote, escaped = 0, "", False
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j if ch == ")" else None
            depth -= 1
        elif ch == "," and depth == 0:
            return j
    return None


def _keyword(segment: str) -> tuple[str, Any] | None:
    """(name, value) of one ``name=literal`` argument; None if it is anything else."""
    try:
        node = ast.parse(f"f({segment})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args or len(node.keywords) != 1 or node.keywords[0].arg is None:
        return None
    try:
        value = ast.literal_eval(node.keywords[0].value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None  # a set, bytes or complex number: no JSON for it
    return node.keywords[0].arg, value
