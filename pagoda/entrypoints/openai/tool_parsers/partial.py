"""Tool calls read while they are being written, for streaming them incrementally.

A call object ``{"name": "f", "arguments": {...}}`` (``"parameters"`` also accepted) is scanned
as far as the text goes: its name once that string is complete, and the text of its arguments
value from where it starts. While the arguments value is an unfinished object or array, all
the text after its start belongs to it, so that text is a prefix of the call's final arguments:
it can be sent at once, and the rest follows as it is written. The call's arguments are that raw
text (as the model wrote it), in the streamed and the whole-text answer alike, so the streamed
pieces concatenate to exactly the non-streamed call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\n\r"


@dataclass
class PartialCall:
    """A call as far as it is written: ``name`` (None until known), ``arguments`` (a prefix of
    the final arguments text; the whole of it once ``complete``)."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class ObjectScan:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # exclusive; None while the value is unfinished
    end: int | None = None  # just past the closing brace; None while unfinished
    invalid: bool = False


def skip_ws(text: str, i: int, extra: str = "") -> int:
    while i < len(text) and (text[i] in _WS or text[i] in extra):
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """Just past the JSON value starting at ``text[i]``; None if it is not finished in ``text``
    (or not a JSON value: the caller parses finished values)."""
    if i >= len(text):
        return None
    c = text[i]
    if c in "{[":
        depth, in_string, escaped = 0, False, False
        for j in range(i, len(text)):
            ch = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    if c == '"':
        escaped = False
        for j in range(i + 1, len(text)):
            if escaped:
                escaped = False
            elif text[j] == "\\":
                escaped = True
            elif text[j] == '"':
                return j + 1
        return None
    for j in range(i, len(text)):  # number or literal: ends at a delimiter
        if text[j] in _WS or text[j] in ",}]":
            return j
    return None


def scan_object(text: str, i: int) -> ObjectScan:
    """Scan the call object starting at ``text[i] == "{"`` as far as ``text`` goes."""
    out = ObjectScan()
    j = i + 1
    while True:
        j = skip_ws(text, j, ",")
        if j >= len(text):
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != '"':
            out.invalid = True
            return out
        key_end = value_end(text, j)
        if key_end is None:
            return out
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            out.invalid = True
            return out
        j = skip_ws(text, key_end)
        if j >= len(text):
            return out
        if text[j] != ":":
            out.invalid = True
            return out
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return out
        end = value_end(text, j)
        if key in ARGUMENT_KEYS and out.args_start is None:
            out.args_start, out.args_end = j, end
        elif key == "name" and end is not None and out.name is None:
            try:
                name = json.loads(text[j:end])
            except ValueError:
                name = None
            out.name = name if isinstance(name, str) else None
        if end is None:
            return out
        j = end


def partial_call(text: str, scan: ObjectScan) -> PartialCall | None:
    """What of a call being written can be sent: None until its name is known and its
    arguments object (or array) has started; a finished call whose arguments are another kind
    of value is sent whole (``complete_call``)."""
    if scan.invalid or scan.name is None or scan.args_start is None or text[scan.args_start] not in "{[":
        return None
    args = text[scan.args_start:scan.args_end if scan.args_end is not None else len(text)]
    return PartialCall(scan.name, args, False)


def complete_call(text: str, start: int, end: int) -> tuple[str, str] | None:
    """The call in the finished object ``text[start:end]``: (name, arguments text), the raw
    text of an object or array argument, the value of a string one, ``{}`` when absent; None if
    it is not a call."""
    try:
        obj = json.loads(text[start:end])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    scan = scan_object(text, start)
    if scan.args_start is None or scan.args_end is None:
        return (obj["name"], "{}") if not any(k in obj for k in ARGUMENT_KEYS) else None
    raw = text[scan.args_start:scan.args_end]
    value = json.loads(raw)
    if isinstance(value, str):
        return obj["name"], value
    return obj["name"], raw


def array_calls(text: str, i: int, final: bool, cut: bool = False) -> tuple[list[PartialCall], int | None]:
    """The call objects of a JSON array whose ``[`` ends just before ``text[i]``: the complete
    ones, and (while not ``final``, or when ``cut``: output ended at ``max_tokens``) the one being
    written, kept with ``cut`` once its name is known. Also where the array ends (just past
    ``]``), None while it is open or when something not a call is there."""
    calls: list[PartialCall] = []
    while True:
        i = skip_ws(text, i, ",")
        if i < len(text) and text[i] == "]":
            return calls, i + 1
        if i >= len(text) or text[i] != "{":
            return calls, None
        end = value_end(text, i)
        if end is None:
            scan = scan_object(text, i)
            call = partial_call(text, scan) if not final or cut else None
            if call is None and cut and scan.name is not None and not scan.invalid:
                # Cut before its arguments object started: the call with what there is.
                call = PartialCall(scan.name, text[scan.args_start:] if scan.args_start is not None else "", False)
            if call is not None:
                calls.append(call)
            return calls, None
        whole = complete_call(text, i, end)
        if whole is None:
            return calls, None
        calls.append(PartialCall(*whole, True))
        i = end
