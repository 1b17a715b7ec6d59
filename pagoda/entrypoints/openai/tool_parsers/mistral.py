"""Mistral: ``[TOOL_CALLS]`` then the calls, either as a JSON array of ``{"name", "arguments"}``
objects (older tokenizers: ``[TOOL_CALLS][{...}, {...}]``) or one call per tag as
``[TOOL_CALLS]name[ARGS]{...}`` (newer ones). Text before the first tag is content."""
from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import ToolParser, partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall, array_calls, skip_ws, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return (len(text) if final else len(text) - partial_suffix(text, TOOL_CALLS)), []
        i = skip_ws(text, start + len(TOOL_CALLS))
        if i < len(text) and text[i] == "[":
            calls, _ = array_calls(text, i + 1, final)
        else:
            calls = _tagged_calls(text, start, final)
        if final and not calls:
            return len(text), []  # no parsable call after all: everything was content
        return start, calls


def _tagged_calls(text: str, at: int, final: bool) -> list[PartialCall]:
    """``[TOOL_CALLS]name[ARGS]{...}`` calls from ``text[at]`` on."""
    calls: list[PartialCall] = []
    while text.startswith(TOOL_CALLS, at):
        sep = text.find(ARGS, at)
        if sep < 0:
            return calls
        name = text[at + len(TOOL_CALLS):sep].strip()
        i = skip_ws(text, sep + len(ARGS))
        if not name or i >= len(text) or text[i] not in "{[":
            return calls
        end = value_end(text, i)
        if end is None:
            if not final:
                calls.append(PartialCall(name, text[i:], False))
            return calls
        calls.append(PartialCall(name, text[i:end], True))
        at = skip_ws(text, end)
    return calls
