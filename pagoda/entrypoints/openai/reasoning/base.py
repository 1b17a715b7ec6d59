"""The reasoning-parser interface: split a model's ``<think>…</think>`` reasoning from its answer.

A parser is built once per server from the tokenizer (its tags must be single tokens, so that
the engine can tell from token ids where the reasoning ends). ``split(text)`` splits a finished
output; ``streamer()`` gives a ``ReasoningStreamer`` that splits the same output delta by delta:
the deltas of each part concatenate to ``split``'s parts, however the text is cut (a tag spread
over several deltas is held back until it is known to be one, or not).
"""
from __future__ import annotations

from typing import Any, Sequence

from pagoda.entrypoints.openai.tool_parsers.base import partial_suffix
from pagoda.structured_output.params import StructuredOutputsParams

# Where a streamer is in the output.
OPENING = "opening"  # before the reasoning: a start tag may come (or, implicitly, not)
BEFORE = "before"  # plain content that a start tag would turn into reasoning
REASONING = "reasoning"
ANSWER = "answer"


class ReasoningStreamer:
    """One output's split, fed delta by delta. ``feed(delta, final)`` returns the new
    (reasoning, content) text, each None when empty."""

    def __init__(self, parser: "ReasoningParser") -> None:
        self.parser = parser
        self.state = OPENING if parser.implicit_start else BEFORE
        self.held = ""  # text not yet given out (maybe the start of a tag)

    def feed(self, delta: str, final: bool) -> tuple[str | None, str | None]:
        self.held += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            step = self._step(final, reasoning, content)
            if not step:
                break
        return "".join(reasoning) or None, "".join(content) or None

    def _step(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Consume what can be decided of ``held``; True when the state changed (go again)."""
        start, end, text = self.parser.start_tag, self.parser.end_tag, self.held
        if self.state == OPENING:
            # An optional start tag right at the beginning (the template may have written it).
            if text.startswith(start):
                self.held, self.state = text[len(start):], REASONING
                return True
            if start.startswith(text) and not final:
                return False  # maybe the start tag, not complete yet
            self.state = REASONING
            return True
        if self.state == ANSWER:
            content.append(text)
            self.held = ""
            return False
        tag, out = (end, reasoning) if self.state == REASONING else (start, content)
        at = text.find(tag)
        if at >= 0:
            out.append(text[:at])
            self.held = text[at + len(tag):]
            self.state = ANSWER if self.state == REASONING else REASONING
            return True
        keep = 0 if final else partial_suffix(text, tag)
        out.append(text[:len(text) - keep])
        self.held = text[len(text) - keep:]
        return False


class ReasoningParser:
    """Tags and token ids of one reasoning format. ``implicit_start``: the output is reasoning
    from its first token (the chat template opened it), a leading start tag is optional;
    otherwise reasoning starts only at a start tag, and the text before it is content."""

    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    implicit_start = False
    # True: the format's markers are special tokens, so the output is decoded with them kept
    # (the parser takes them out of both parts).
    reads_special_tokens = False

    def __init__(self, tokenizer: Any) -> None:
        self.start_token_id = _single_token(tokenizer, self.start_tag, self.name)
        self.end_token_id = _single_token(tokenizer, self.end_tag, self.name)

    def streamer(self, tool_calls: bool = False, forced: bool = False) -> ReasoningStreamer:
        """A split delta by delta. ``tool_calls``: the request's tool parser reads calls in this
        format's own markup from the content (formats whose calls are not plain text need it).
        ``forced``: a forced tool call's grammar wrote the answer (formats that frame calls in
        their own markup hand its body on as the content)."""
        return ReasoningStreamer(self)

    def split(self, text: str, tool_calls: bool = False, forced: bool = False) -> tuple[str | None, str | None]:
        """A finished output's (reasoning, content), each None when empty."""
        return self.streamer(tool_calls, forced).feed(text, final=True)

    def reasoning_tokens(self, ids: Sequence[int]) -> int:
        """How many of an output's tokens (that has reasoning) are its reasoning."""
        return ids.index(self.end_token_id) + 1 if self.end_token_id in ids else len(ids)

    def delay_grammar(self, constraint: StructuredOutputsParams, prompt_ids: Sequence[int]) -> None:
        """Make ``constraint`` (a structured-output or forced-call grammar) apply to the answer
        only, after the reasoning this prompt's output will hold (``grammar_start_after``)."""
        constraint.start_after_token_id = self.grammar_start_after(prompt_ids)

    def grammar_start_after(self, prompt_ids: Sequence[int]) -> int | None:
        """The token after which a structured-output grammar starts applying to this prompt's
        output: the end tag's id while the prompt leaves reasoning open or yet to come; None
        (the grammar applies from the first token) when the prompt's last tag closed it (a
        template that turned thinking off writes an empty ``<think></think>``)."""
        for token in reversed(prompt_ids):
            if token == self.end_token_id:
                return None
            if token == self.start_token_id:
                break
        return self.end_token_id


def _single_token(tokenizer: Any, tag: str, parser: str) -> int:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"--reasoning-parser {parser} needs {tag!r} to be one token of the model's tokenizer; "
                         f"it encodes to {len(ids)} tokens")
    return ids[0]
