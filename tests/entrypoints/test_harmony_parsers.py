"""gpt-oss's harmony format on text (no model): the ``openai_gptoss`` reasoning split and the
``openai`` tool parser, whole and fed in pieces cut anywhere (markers split across deltas)."""
from __future__ import annotations

import pytest

from pagoda.entrypoints.openai.reasoning import get_reasoning_parser
from pagoda.entrypoints.openai.structured import ToolPlan, ToolStreamer
from pagoda.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser

SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>",
            "<|endoftext|>")
REASONED = ("<|channel|>analysis<|message|>Think <|x|> hard.<|end|><|start|>assistant<|channel|>final<|message|>42."
            "<|return|>")
CALL = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
# The recipient in the header before the channel; a preamble first; two calls.
CALLS_IN_HEADER = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather'
                   '<|channel|>commentary json<|message|>{"city": "Oslo"}<|end|><|start|>assistant to=functions.add'
                   '<|channel|>commentary <|constrain|>json<|message|>{"a": 1}<|call|>')


class Tokenizer:
    """What the parser reads of a tokenizer: single-token markers, the special tokens."""

    all_special_tokens = list(SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [SPECIALS.index(text)] if text in SPECIALS else list(range(100, 100 + len(text)))


@pytest.fixture(scope="module")
def parser():
    return get_reasoning_parser("openai_gptoss", Tokenizer())


def pieces(text: str, step: int) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


def fed(parser, text: str, step: int, tool_calls: bool = False) -> tuple[str, str, list[str]]:
    streamer, reasoning, content, deltas = parser.streamer(tool_calls), "", "", []
    parts = pieces(text, step)
    for i, piece in enumerate(parts):
        r, c = streamer.feed(piece, i == len(parts) - 1)
        reasoning, content = reasoning + (r or ""), content + (c or "")
        deltas += [r or "", c or ""]
    return reasoning, content, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
def test_reasoning_split_whole_and_streamed(parser, step):
    assert parser.split(REASONED) == ("Think <|x|> hard.", "42.")  # <|x|> is no special token: text
    reasoning, content, deltas = fed(parser, REASONED, step)
    assert (reasoning, content) == ("Think <|x|> hard.", "42.")
    # No delta ever carries a piece of a marker (only the model's own "<|x|>", whole).
    assert all("<|" not in d.replace("<|x|>", "") and "|>" not in d.replace("<|x|>", "") for d in deltas)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_cut_inside_the_analysis_is_all_reasoning(parser, step):
    text = "<|channel|>analysis<|message|>Think ha"
    assert parser.split(text) == ("Think ha", None)
    assert fed(parser, text, step)[:2] == ("Think ha", "")
    # Cut inside a header: nothing of the header is anyone's text.
    assert parser.split(REASONED[:REASONED.index("final") + 3]) == ("Think <|x|> hard.", None)


def test_plain_output_is_content(parser):
    # A grammar shaped the output from its first token: no framing, the stop token dropped.
    assert parser.split('{"ok": true}<|return|>') == (None, '{"ok": true}')
    assert fed(parser, '{"ok": true}<|return|>', 1)[:2] == ("", '{"ok": true}')


def test_calls_dropped_unless_the_tool_parser_reads_them(parser):
    assert parser.split(CALL) == ("Need weather.", None)
    reasoning, content = parser.split(CALL, tool_calls=True)
    assert reasoning == "Need weather."
    assert content == '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>'


def stream_calls(plan: ToolPlan, parser, text: str, step: int) -> tuple[str, str, list[tuple[str, str]]]:
    streamer, thinker, reasoning, content, calls = ToolStreamer(plan), parser.streamer(True), "", "", {}
    parts = pieces(text, step)
    for i, piece in enumerate(parts):
        final = i == len(parts) - 1
        r, c = thinker.feed(piece, final)
        reasoning += r or ""
        if c or final:
            delta, deltas = streamer.feed(c or "", final)
            content += delta or ""
            for d in deltas:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text,reasoning,content,calls", [
    (CALL, "Need weather.", None, [("get_weather", '{"city": "Paris"}')]),
    (CALLS_IN_HEADER, None, "Checking.", [("get_weather", '{"city": "Oslo"}'), ("add", '{"a": 1}')]),
])
@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_calls_whole_and_streamed(parser, text, reasoning, content, calls, step):
    plan = ToolPlan("auto", [], parser=get_tool_parser("openai"))
    assert plan.reads_markers
    split_reasoning, rest = parser.split(text, tool_calls=True)
    whole_content, whole_calls = plan.result(rest)
    assert (split_reasoning, whole_content) == (reasoning, content)
    assert [(c.function.name, c.function.arguments) for c in whole_calls] == calls
    assert stream_calls(plan, parser, text, step) == (reasoning or "", content or "", calls)


def test_the_tool_parser_reads_raw_harmony_too():
    plan = ToolPlan("auto", [], parser=get_tool_parser("openai"))
    content, calls = plan.result('Sure. <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}'
                                 '<|call|>')
    assert content == "Sure. " and [(c.function.name, c.function.arguments) for c in calls] == [("f", "{}")]
    # A call the output ends inside is no call, and its markup never becomes content; cut by
    # max_tokens it is the call so far, as its streamed deltas were.
    cut = 'Hi <|channel|>commentary to=functions.f<|message|>{"a"'
    content, calls = plan.result(cut)
    assert content == "Hi " and calls == []
    content, calls = plan.result(cut, cut=True)
    assert content == "Hi " and [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"a"')]
    streamer, streamed = ToolStreamer(plan), {}
    for i, piece in enumerate(pieces(cut, 3)):
        for d in streamer.feed(piece, i == len(pieces(cut, 3)) - 1, True)[1]:
            streamed[d.index] = streamed.get(d.index, "") + (d.function.arguments or "")
    assert streamed == {0: '{"a"'}


def test_auto_detects_harmony_templates():
    template = ("{% for tool in tools %}{{ tool.name }}{% endfor %}<|start|>assistant<|channel|>commentary "
                "to=functions.{{ name }} <|constrain|>json<|message|>")
    assert detect_tool_parser(template) == "openai"
    # gpt-oss's own template writes the recipient in two pieces; its calls end with <|call|>.
    split = ('{%- for tool_call in message.tool_calls %}{{- "<|start|>assistant to=" }}{{- "functions." + '
             'tool_call.name + "<|channel|>commentary json<|message|>" }}{{- "<|call|>" }}{%- endfor %}{{ tools }}')
    assert detect_tool_parser(split) == "openai"
