"""The reasoning parsers on their own: whole-output splits for each parser's cases, the same
split from every way of cutting the output into deltas (tags cut anywhere, text on both sides
of a tag in one delta), and where a grammar starts for a given prompt."""
from __future__ import annotations

import itertools
from typing import Any

import pytest

from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from pagoda.tools.make_model import build_tokenizer

START, END = "<think>", "</think>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = build_tokenizer(512)
    tok.add_tokens([START, END])
    return tok


# The think-tag parsers (harmony's channels have their own tests: test_harmony_parsers.py).
THINK_PARSERS = sorted(name for name, cls in REASONING_PARSERS.items() if not cls.reads_special_tokens)


@pytest.fixture(scope="module", params=THINK_PARSERS)
def parser(request: pytest.FixtureRequest, tokenizer: Any) -> ReasoningParser:
    return get_reasoning_parser(request.param, tokenizer)


# text -> (reasoning, content) for each parser.
CASES: dict[str, list[tuple[str, tuple[str | None, str | None]]]] = {
    "deepseek_r1": [
        ("step one</think>the answer", ("step one", "the answer")),
        ("<think>step one</think>the answer", ("step one", "the answer")),
        ("no end tag at all", ("no end tag at all", None)),  # never closed: all reasoning
        ("</think>only the answer", (None, "only the answer")),
        ("a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
        ("x<think>y</think>z", ("x<think>y", "z")),  # a start tag not at the start is text
        ("<thi", ("<thi", None)),
        ("", (None, None)),
    ],
    "qwen3": [
        ("<think>step one</think>the answer", ("step one", "the answer")),
        ("plain answer, thinking off", (None, "plain answer, thinking off")),
        ("<think>cut off by max_tokens", ("cut off by max_tokens", None)),
        ("lead<think>r</think>tail", ("r", "leadtail")),
        ("a </think> b", (None, "a </think> b")),  # no start tag: no reasoning
        ("<think></think>\n\nanswer", (None, "\n\nanswer")),
        ("x<thin", (None, "x<thin")),
        ("", (None, None)),
    ],
}


def test_whole_splits(parser: ReasoningParser) -> None:
    for text, expected in CASES[parser.name]:
        assert parser.split(text) == expected, text


def stream(parser: ReasoningParser, deltas: list[str]) -> tuple[list[str | None], list[str | None]]:
    streamer = parser.streamer()
    out = [streamer.feed(d, i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return [r for r, _ in out], [c for _, c in out]


def joined(parts: list[str | None]) -> str | None:
    return "".join(p for p in parts if p) or None


def test_every_cut_streams_the_whole_split(parser: ReasoningParser) -> None:
    """Cut each case at every pair of positions (three deltas, some empty) and one character at
    a time: the deltas of each part join to the whole split (so no piece of a tag leaks into
    either part, however the tag is cut)."""
    for text, expected in CASES[parser.name]:
        cuts = [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations_with_replacement(
            range(len(text) + 1), 2)]
        for deltas in cuts + [list(text) or [""]]:
            reasoning, content = stream(parser, deltas)
            assert (joined(reasoning), joined(content)) == expected, deltas



def test_text_on_both_sides_of_a_tag_in_one_delta(tokenizer: Any) -> None:
    for name in THINK_PARSERS:
        streamer = get_reasoning_parser(name, tokenizer).streamer()
        assert streamer.feed("<think>ab", False) == ("ab", None)
        assert streamer.feed("c</think>de", False) == ("c", "de")
        assert streamer.feed("f", True) == (None, "f")


def test_a_cut_tag_is_held_until_known(tokenizer: Any) -> None:
    streamer = get_reasoning_parser("deepseek_r1", tokenizer).streamer()
    assert streamer.feed("<th", False) == (None, None)  # maybe the optional start tag
    assert streamer.feed("ink>why</th", False) == ("why", None)  # "</th" may end the reasoning
    assert streamer.feed("ought", False) == ("</thought", None)  # it did not
    assert streamer.feed("</", False) == (None, None)
    assert streamer.feed("think>so", True) == (None, "so")
    qwen = get_reasoning_parser("qwen3", tokenizer).streamer()
    assert qwen.feed("hi <thi", False) == (None, "hi ")
    assert qwen.feed("nk>", False) == (None, None)
    assert qwen.feed("r", False) == ("r", None)


def test_grammar_starts_after_the_reasoning(tokenizer: Any, parser: ReasoningParser) -> None:
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    end = parser.end_token_id
    assert end == tokenizer.convert_tokens_to_ids(END)
    # Thinking on: the template leaves reasoning to come (or opened it): wait for </think>.
    assert parser.grammar_start_after(ids("<|im_start|>assistant\n")) == end
    assert parser.grammar_start_after(ids("<|im_start|>assistant\n<think>\n")) == end
    # Thinking off: the template closed an empty block, the grammar applies at once.
    assert parser.grammar_start_after(ids("<|im_start|>assistant\n<think>\n\n</think>\n\n")) is None
    # An earlier turn's closed block does not count once a new one opens.
    assert parser.grammar_start_after(ids("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>\n")) == end


def test_unknown_parser_and_tokenizer_without_tags() -> None:
    with pytest.raises(ValueError, match="unknown --reasoning-parser"):
        get_reasoning_parser("nope", build_tokenizer(512))
    with pytest.raises(ValueError, match="one token"):
        get_reasoning_parser("qwen3", build_tokenizer(512))
