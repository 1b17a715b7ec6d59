"""The tool-call parsers and the streaming of calls, on text (no model needed)."""
from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.structured import ToolPlan, ToolStreamer, strict_schema, tool_plan
from pagoda.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser, resolve_tool_parser

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1}}'
CALLS = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]


# What qwen3_coder types its values by (the others ignore the schemas).
TYPED_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
               {"type": "function", "function": {"name": "search", "parameters": {
                   "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "array"},
                                                    "t": {"type": "boolean"}}}}}]


def _plan(parser: str) -> ToolPlan:
    plan = ToolPlan("auto", TYPED_TOOLS, parser=get_tool_parser(parser))
    plan.parser.tools = TYPED_TOOLS
    return plan


def _stream(plan: ToolPlan, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    streamer, content, calls = ToolStreamer(plan), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta, deltas = streamer.feed(piece, i == len(pieces) - 1)
        content += delta or ""
        for d in deltas:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_whole_and_streamed_agree(step):
    plan = _plan("hermes")
    content, calls = plan.result(HERMES)
    assert content == "Let me check. " and [(c.function.name, c.function.arguments) for c in calls] == CALLS
    assert _stream(plan, HERMES, step) == ("Let me check. ", CALLS)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_whole_and_streamed_agree(step):
    plan = _plan("llama3_json")
    content, calls = plan.result(LLAMA)
    assert content is None and [c.function.name for c in calls] == ["get_weather", "add"]
    assert _stream(plan, LLAMA, step) == ("", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')])


def _check_streamed_per_argument(plan: ToolPlan, text: str, expected: list[tuple[str, str]]) -> None:
    """Formats whose arguments JSON pagoda writes: streamed char by char, the name comes first,
    then the arguments one by one, concatenating to the non-streamed call."""
    streamer, deltas = ToolStreamer(plan), []
    for i, ch in enumerate(text):
        deltas += streamer.feed(ch, i == len(text) - 1)[1]
    first = [d for d in deltas if d.index == 0]
    assert first[0].id and first[0].function.name == "search"
    assert first[0].function.arguments in ("{", '{"q": "a}b{ \\"x]\\" ["')  # qwen3_coder: "{"; pythonic: q
    assert len(first) >= 3  # q first, then n, t as each is finished (and the "}")
    assert "".join(d.function.arguments for d in first) == expected[0][1]
    for step in (2, 5, 1000):
        assert _stream(plan, text, step)[1] == expected


# Each new parser: text, then two calls (content first where the format allows it).
NEW_FORMATS = {
    "mistral": ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Checking. "),
    "deepseek_v3": ('Checking. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
                    '```json\n{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking. "),
    "qwen3_coder": ("Checking. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>", "Checking. "),
    "pythonic": ('[get_weather(city="Paris"), add(a=1, b=2)]', ""),
}


@pytest.mark.parametrize("parser", sorted(NEW_FORMATS))
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_new_parsers_whole_and_streamed_agree(parser, step):
    text, content = NEW_FORMATS[parser]
    plan = _plan(parser)
    whole_content, calls = plan.result(text)
    assert whole_content == (content or None) and [(c.function.name, c.function.arguments) for c in calls] == CALLS
    assert _stream(plan, text, step) == (content, CALLS)


@pytest.mark.parametrize("parser,text", [
    ("mistral", "[TOOL_CALL no tag here"), ("mistral", "[TOOL_CALLS]not a call"),
    ("mistral", "[TOOL_CALLS][{not json}]"), ("deepseek_v3", "<｜tool▁calls▁begin｜>nothing"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\nnope```"),
    ("qwen3_coder", "<tool_call>plain</tool_call>"), ("qwen3_coder", "a <tool_ b"),
    ("pythonic", "[citation needed]"), ("pythonic", "[f(1, 2)]"),  # positional: not a call
    ("pythonic", "[f(x=__import__('os').system('true'))]"),  # not a literal: never evaluated
    ("pythonic", "plain [f(x=1)]"), ("pythonic", "[f(x={1, 2})]"), ("pythonic", "[f(x=1)] and more"),
])
def test_new_parsers_text_without_a_call_is_content(parser, text):
    plan = _plan(parser)
    assert plan.result(text) == (text, [])
    if text.endswith("and more"):  # a stream has sent the call before the text after the list
        return
    assert _stream(plan, text, 2) == (text, [])


@pytest.mark.parametrize("parser,text", [("hermes", "no call <tool_ here"), ("llama3_json", "plain {text}"),
                                         ("hermes", "<tool_call>{not json</tool_call>"),
                                         ("llama3_json", '{"not": "a call"}')])
def test_text_without_a_call_is_content(parser, text):
    plan = _plan(parser)
    assert plan.result(text) == (text, [])
    assert _stream(plan, text, 2) == (text, [])


def test_forced_required_calls_stream_as_they_complete():
    plan = ToolPlan("required", [{"type": "function", "function": {"name": "add"}}])
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"b": 2}}]'
    assert _stream(plan, text, 4) == ("", [("add", '{"a": 1}'), ("add", '{"b": 2}')])
    named = ToolPlan("named", [{"type": "function", "function": {"name": "add"}}], named="add")
    assert _stream(named, '{"a": 1}', 2) == ("", [("add", '{"a": 1}')])


def test_required_grammar_covers_every_tool_and_parallel_false_allows_one():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
                  {"type": "function", "function": {"name": "b"}}]})
    plan = tool_plan(req, None)
    plan.stop_at_boundary = False  # the xgrammar form: a closed JSON array
    schema = plan.constraint().json
    assert schema["maxItems"] == 1 and [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]] == ["a", "b"]
    assert json.dumps(schema)  # a plain JSON schema
    plan.stop_at_boundary = True  # llguidance's Lark: one call, then the end or "]"
    lark = plan.constraint().grammar
    assert lark.startswith('start: "[" call "]"?\n') and '"const": "b"' in lark
    plan.parallel = True
    assert plan.constraint().grammar.startswith('start: "[" call ("," call)* "]"?\n')


def test_strict_schema_closes_objects_that_list_properties():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "free": {"type": "object"},
                                               "open": {"type": "object", "properties": {}, "additionalProperties": True},
                                               "list": {"type": "array", "items": {"properties": {"y": {}}}}},
              "$defs": {"d": {"type": "object", "properties": {"z": {}}}}, "default": {"properties": {}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["properties"]["additionalProperties"] is False  # a property named "properties" is a schema
    assert "additionalProperties" not in props["free"]  # a bare object stays any object
    assert props["open"]["additionalProperties"] is True  # what the schema says wins
    assert props["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["default"] == {"properties": {}}  # values, not schemas, are left alone
    assert "additionalProperties" not in schema  # the tool's own schema is not changed
    named = ToolPlan("named", [{"type": "function", "function": {"name": "f", "parameters": schema}}], named="f")
    assert named.constraint().json["additionalProperties"] is False
    named.strict = False
    assert "additionalProperties" not in named.constraint().json


def _cut_stream(plan: ToolPlan, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """As _stream, the last piece flagged as cut by max_tokens."""
    streamer, content, calls = ToolStreamer(plan), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, deltas = streamer.feed(piece, last, cut=last)
        content += delta or ""
        for d in deltas:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text,calls", [
    ('[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"b": 2', [("add", '{"a": 1}'),
                                                                                       ("add", '{"b": 2')]),
    ('[{"name": "add", "parameters": {"a": 1', [("add", '{"a": 1')]),
    ('[{"name": "add", "parame', [("add", "")]),  # the name is written, the arguments not begun
    ('[{"name": "add", "parameters": ', [("add", "")]),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_required_call_cut_by_max_tokens_is_a_call_with_its_arguments_so_far(text, calls, step):
    plan = ToolPlan("required", [{"type": "function", "function": {"name": "add"}}])
    content, whole = plan.result(text, cut=True)
    assert content is None and [(c.function.name, c.function.arguments) for c in whole] == calls
    assert _cut_stream(plan, text, step) == ("", calls)
    # Not cut (the grammar let it stop there): only its complete calls are calls.
    assert [(c.function.name, c.function.arguments) for c in plan.result(text)[1]] == calls[:-1]


@pytest.mark.parametrize("text", ['[{"na', "[", '[{"name": "ad'])
@pytest.mark.parametrize("step", [1, 1000])
def test_required_output_cut_before_any_name_is_content(text, step):
    plan = ToolPlan("required", [{"type": "function", "function": {"name": "add"}}])
    assert plan.result(text, cut=True) == (text, [])
    assert _cut_stream(plan, text, step) == (text, [])


def test_named_call_cut_by_max_tokens_has_its_arguments_so_far():
    named = ToolPlan("named", [{"type": "function", "function": {"name": "add"}}], named="add")
    content, calls = named.result('{"a": 1, "b', cut=True)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [("add", '{"a": 1, "b')]
    assert _cut_stream(named, '{"a": 1, "b', 3) == ("", [("add", '{"a": 1, "b')])


def test_bitmask_kernel_and_torch_paths_agree():
    """The sampler applies a grammar's bitmask with xgrammar's fused kernel when it can, else by
    unpacking in torch: both give the same logits, rows without a mask untouched."""
    import torch

    from pagoda.executor import sampler
    from pagoda.sampling_params import SamplingParams

    vocab = 1000
    masks = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    rows = [sampler.SampleRow(SamplingParams(), None, [1], [], (), m) for m in (masks[0], None, masks[2])]
    logits = torch.randn(3, vocab)
    fused = logits.clone()
    sampler.apply_bitmasks(fused, rows)
    allowed = sampler.unpack_bitmask(masks, vocab)
    expected = logits.clone()
    for i in (0, 2):
        expected[i][~allowed[i]] = float("-inf")
    assert torch.equal(fused, expected)
    plain = logits.clone().to(torch.float64)  # not the kernel's dtype: the torch path
    sampler.apply_bitmasks(plain, rows)
    assert torch.equal(plain.float(), expected)


TRICKY_ARGS = '{"q": "a}b{ \\"x]\\" [", "n": [1, {"x": 2.5e3}], "t": true}'


@pytest.mark.parametrize("parser,text", [
    ("hermes", f'Sure.<tool_call>\n{{"name": "search", "arguments": {TRICKY_ARGS}}}\n</tool_call>'
               '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
    ("llama3_json", f'<|python_tag|>{{"name": "search", "parameters": {TRICKY_ARGS}}}; '
                    '{"name": "add", "parameters": {"a": 1}}'),
    ("required", f'[{{"name": "search", "parameters": {TRICKY_ARGS}}}, {{"name": "add", "parameters": {{"a": 1}}}}]'),
    ("mistral", f'[TOOL_CALLS][{{"name": "search", "arguments": {TRICKY_ARGS}}}, '
                '{"name": "add", "arguments": {"a": 1}}]'),
    ("mistral", f'[TOOL_CALLS]search[ARGS]{TRICKY_ARGS}[TOOL_CALLS]add[ARGS]{{"a": 1}}'),
    ("deepseek_v3", f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{TRICKY_ARGS}\n```"
                    '<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1}\n```'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("deepseek_v3", f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{TRICKY_ARGS}<｜tool▁call▁end｜>"
                    '<｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),

    ("qwen3_coder", '<tool_call>\n<function=search>\n<parameter=q>\na}b{ "x]" [\n</parameter>\n<parameter=n>\n'
                    '[1, {"x": 2.5e3}]\n</parameter>\n<parameter=t>\ntrue\n</parameter>\n</function>\n</tool_call>'
                    '<tool_call><function=add><parameter=a>1</parameter></function></tool_call>'),
    ("pythonic", '[search(q=\'a}b{ "x]" [\', n=[1, {"x": 2.5e3}], t=True), add(a=1)]'),
])
def test_calls_stream_incrementally_name_first_then_arguments(parser, text):
    """A call is streamed while it is written: a first delta with id and name (the arguments
    begun so far), then argument pieces; the pieces concatenate to the non-streamed call's
    arguments exactly, also with braces, brackets and escaped quotes inside strings."""
    if parser == "required":
        plan = ToolPlan("required", [{"type": "function", "function": {"name": "search"}}])
    else:
        plan = _plan(parser)
    _, whole = plan.result(text)
    expected = [(c.function.name, c.function.arguments) for c in whole]
    assert [n for n, _ in expected] == ["search", "add"] and json.loads(expected[1][1]) == {"a": 1}
    args = expected[0][1]
    assert json.loads(args) == json.loads(TRICKY_ARGS)
    if parser in ("qwen3_coder", "pythonic"):
        return _check_streamed_per_argument(plan, text, expected)
    assert args == TRICKY_ARGS
    streamer, deltas = ToolStreamer(plan), []
    for i, ch in enumerate(text):
        deltas += streamer.feed(ch, i == len(text) - 1)[1]
    first = [d for d in deltas if d.index == 0]
    assert first[0].id and first[0].function.name == "search" and len(first[0].function.arguments) < 3
    assert len(first) > len(TRICKY_ARGS) // 2  # the arguments went out piece by piece
    assert all(d.id is None and d.function.name is None for d in first[1:])
    assert "".join(d.function.arguments for d in first) == TRICKY_ARGS
    for step in (2, 5, 1000):
        assert _stream(plan, text, step)[1] == expected


QWEN_LIKE = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
             "</tools>\nreturn a json object within <tool_call></tool_call> XML tags{% endif %}")
LLAMA31_LIKE = ("{%- if tools is not none %}{{- 'Respond in the format {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}' }}{% endif %}"
                "{%- if tool_call.name == 'brave_search' %}{{- '<|python_tag|>' + tool_call.name }}{% endif %}")


@pytest.mark.parametrize("template,parser", [
    (QWEN_LIKE, "hermes"), (LLAMA31_LIKE, "llama3_json"), ({"default": QWEN_LIKE, "rag": "x"}, "hermes"),
    (QWEN_LIKE.replace("return a json object", "<function=example_function_name>"), "qwen3_coder"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{% if tools %}{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}{% endif %}", "deepseek_v3"),
    ("{% if tools %}{{ '<|python_start|>[func(a=1)]<|python_end|>' }}{% endif %}", "pythonic"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),  # no tools
    ("{% if tools %}{{ tools | tojson }}{% endif %}", None),  # tools, no known call format
    ("<tool_call> shown, with no tool list", None), (None, None),
])
def test_detect_tool_parser_from_the_chat_template(template, parser):
    assert detect_tool_parser(template) == parser


def test_resolve_tool_parser_keeps_the_old_flags_and_defaults_to_auto():
    assert resolve_tool_parser(None, False, QWEN_LIKE) == "hermes"  # a plain server
    assert resolve_tool_parser("auto", True, LLAMA31_LIKE) == "llama3_json"
    assert resolve_tool_parser(None, False, "{{ messages }}") is None  # "auto" stays refused
    assert resolve_tool_parser("llama3_json", True, QWEN_LIKE) == "llama3_json"  # a named parser wins
    assert resolve_tool_parser("hermes", False, None) == "hermes"
    assert resolve_tool_parser("none", False, QWEN_LIKE) is None
    for flag, template in (("auto", "{{ messages }}"), ("none", QWEN_LIKE)):
        with pytest.raises(ValueError, match="--tool-call-parser"):
            resolve_tool_parser(flag, True, template)
