"""gpt-oss (harmony): a call is a ``commentary`` message to ``functions.NAME`` whose body is the
arguments JSON, ending at ``<|call|>``. The text it reads is the harmony reasoning parser's
content (``reasoning/openai_gptoss``), where each call stands in canonical form after the
answer's text; raw harmony text (the recipient before or after the channel, ``<|constrain|>``)
reads the same. Content is the text before the first marker; a call streams its arguments as
they are written (``<|call|>`` or the next marker ends them). A call the output ends inside is
returned incomplete: it counts only for an output cut by ``max_tokens`` (``ToolPlan.result``)."""
from __future__ import annotations

from pagoda.entrypoints.openai.harmony import (BODY_ENDS, CHANNEL, FUNCTIONS, MESSAGE, START, TOOL, held_suffix,
                                               parse_header)
from pagoda.entrypoints.openai.tool_parsers.base import ToolParser
from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall


class OpenAIToolParser(ToolParser):
    name = "openai"
    reads_special_tokens = True

    def scan_partial(self, text: str, final: bool) -> tuple[int, list[PartialCall]]:
        start = _first(text, (CHANNEL, START))
        if start < 0:
            return (len(text) if final else len(text) - held_suffix(text)), []
        calls: list[PartialCall] = []
        at = start
        while (head := text.find(MESSAGE, at)) >= 0:
            header = parse_header(text[at:head])
            body_start = head + len(MESSAGE)
            end, marker = _body_end(text, body_start)
            body = text[body_start:end if end >= 0 else len(text)]
            if end < 0 and not final:
                body = body[:len(body) - held_suffix(body)]
            if header.kind == TOOL:  # unfinished at the end: a call cut short (complete False)
                calls.append(PartialCall(header.recipient[len(FUNCTIONS):], body, end >= 0))  # type: ignore[index]
            if end < 0:
                break
            at = end + (len(marker) if marker != START else 0)
        return start, calls


def _first(text: str, markers: tuple[str, ...]) -> int:
    found = [at for at in (text.find(m) for m in markers) if at >= 0]
    return min(found) if found else -1


def _body_end(text: str, i: int) -> tuple[int, str]:
    """Where the body from ``text[i]`` ends and the marker that ends it (-1 while it goes on)."""
    found = [(text.find(m, i), m) for m in (*BODY_ENDS, START)]
    found = [(at, m) for at, m in found if at >= 0]
    return min(found) if found else (-1, "")
