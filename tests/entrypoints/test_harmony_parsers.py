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


def test_a_grammar_starts_at_the_first_body_that_is_not_the_analysis(parser):
    from pagoda.structured_output.params import StructuredOutputsParams

    tok = Tokenizer()
    C, M, E, S = (tok.encode(m)[0] for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    word = tok.encode  # the fake's words are runs of ids from 100: the skip compares whole sequences
    prompt = [S, *word("user"), M, *word("hi"), E, S, *word("assistant")]
    so = StructuredOutputsParams(json={"type": "object"})
    parser.delay_grammar(so, prompt)
    assert so.start_after_token_id == M and so.start_skip_after == [[C, *word("analysis")]]
    analysis = [C, *word("analysis"), M, 7, 8, E, S, *word("assistant")]
    assert so.grammar_start(analysis) is None  # reasoning so far: free
    final = [*analysis, C, *word("final"), M, 9]
    assert so.grammar_start(final) == len(final) - 1  # from the final body's first token
    call = [*analysis, C, *word("commentary to=functions.f"), M]
    assert so.grammar_start(call) == len(call)  # a call's arguments (a forced call)
    assert so.grammar_start([C, *word("final"), M]) == 2 + len(word("final"))  # no analysis at all
    # A prompt that leaves a final body open (prefilled): the grammar applies at once.
    prefilled = StructuredOutputsParams(json={"type": "object"})
    parser.delay_grammar(prefilled, [*prompt, C, *word("final"), M])
    assert prefilled.start_after_token_id is None and prefilled.grammar_start([5]) == 0
    # ... but an open analysis body delays it as usual.
    thinking = StructuredOutputsParams(json={"type": "object"})
    parser.delay_grammar(thinking, [*prompt, C, *word("analysis"), M])
    assert thinking.start_after_token_id == M


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_forced_call_body_is_the_answer(parser, step):
    """A forced call's grammar wrote the call's body: the split hands it on as the content (the
    forced-call result reads it), with the analysis as reasoning; unforced, it is dropped."""
    assert parser.split(CALL, False, True) == ("Need weather.", '{"city": "Paris"}')
    assert parser.split(CALL) == ("Need weather.", None)
    streamer, reasoning, content = parser.streamer(False, True), "", ""
    parts = pieces(CALL, step)
    for i, piece in enumerate(parts):
        r, c = streamer.feed(piece, i == len(parts) - 1)
        reasoning, content = reasoning + (r or ""), content + (c or "")
    assert (reasoning, content) == ("Need weather.", '{"city": "Paris"}')
