"""DeepSeek V3 / R1: calls in a ``<｜tool▁calls▁begin｜>`` … ``<｜tool▁calls▁end｜>`` section, each
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then a fenced ```` ```json ```` block of arguments
and ``<｜tool▁call▁end｜>`` (V3.1 writes ``NAME<｜tool▁sep｜>{...}`` without the type and fence; both
are read). Text before the section is content."""
from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import ToolParser, partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall, skip_ws, value_end

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return (len(text) if final else len(text) - partial_suffix(text, CALLS_BEGIN)), []
        calls: list[PartialCall] = []
        at = start + len(CALLS_BEGIN)
        while True:
            begin = text.find(CALL_BEGIN, at)
            if begin < 0:
                break
            call, at = _call(text, begin + len(CALL_BEGIN), final)
            if call is not None:
                calls.append(call)
            if at is None:
                break
        if final and not calls:
            return len(text), []  # no parsable call after all: everything was content
        return start, calls


def _call(text: str, i: int, final: bool) -> tuple[PartialCall | None, int | None]:
    """The call whose body starts at ``text[i]``, and where the next may start (None: no more)."""
    sep = text.find(SEP, i)
    if sep < 0:
        return None, None
    head = text[i:sep].strip()
    j = sep + len(SEP)
    if head == "function":  # V3: the name on its own line, then a ```json fence
        line_end = text.find("\n", j)
        if line_end < 0:
            return None, None
        name = text[j:line_end].strip()
        j = skip_ws(text, line_end)
        if text.startswith(FENCE, j):
            fence_line = text.find("\n", j)
            if fence_line < 0:
                return None, None
            j = fence_line + 1
    else:  # V3.1: NAME<｜tool▁sep｜>{...}
        name = head
    j = skip_ws(text, j)
    if not name or j >= len(text) or text[j] not in "{[":
        return None, None
    end = value_end(text, j)
    if end is None:
        return (PartialCall(name, text[j:], False) if not final else None), None
    close = text.find(CALL_END, end)
    if close < 0:
        return (PartialCall(name, text[j:end], True) if final else PartialCall(name, text[j:end], False)), None
    tail = text[end:close].strip()
    if tail not in ("", FENCE):
        return None, close + len(CALL_END)
    return PartialCall(name, text[j:end], True), close + len(CALL_END)
