"""gpt-oss's harmony format, read from detokenized text with its markers kept.

After the generation prompt ``<|start|>assistant`` a harmony model writes messages, each a
header and a body: ``<|channel|>analysis<|message|>...<|end|>``, then ``<|start|>assistant``
and the next header. A header names the channel (``analysis``: reasoning; ``final``: the answer;
``commentary``: a tool call when the header also names a recipient, ``to=functions.NAME``, which
may sit before or after the channel, else a preamble the user sees) and maybe a content type
(``<|constrain|>json``). A body ends at ``<|end|>``, or at ``<|return|>`` / ``<|call|>``, which
also end generation.

The markers are special tokens, so the server decodes a harmony request's output with special
tokens kept (the parsers' ``reads_special_tokens``) and ``HarmonySplitter`` takes them out
again: it turns the text, delta by delta, into reasoning, content and calls. Calls are handed on
to the ``openai`` tool parser in one canonical form, ``<|channel|>commentary
to=functions.NAME<|message|>ARGS<|call|>``, when the request's tool parser reads them; otherwise
they are dropped; under a forced call (whose grammar shaped the call's body) the body is the
answer, handed on as plain content. An output that does not open with a marker (a grammar
shaped it from its first token) is plain content. Other special tokens in a body (``<|endoftext|>``) are dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
BODY_ENDS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)

# A special-token-like span, and a suffix that may be the start of one (held back while streaming).
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_PARTIAL = re.compile(r"<(\|[A-Za-z0-9_]*\|?)?$")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_]+)")
FUNCTIONS = "functions."

REASONING, CONTENT, TOOL, DROP = "reasoning", "content", "tool", "drop"


@dataclass
class Header:
    channel: str | None
    recipient: str | None

    @property
    def kind(self) -> str:
        """Where the body goes: reasoning, content, a tool call, or nowhere (a built-in tool's
        call, which pagoda does not run)."""
        if self.recipient is not None:
            return TOOL if self.recipient.startswith(FUNCTIONS) else DROP
        return REASONING if self.channel == "analysis" else CONTENT


def parse_header(text: str) -> Header:
    """The channel and recipient of a header (the text before ``<|message|>``)."""
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return Header(channel.group(1) if channel else None, recipient.group(1) if recipient else None)


def call_header(name: str) -> str:
    """The canonical header of a call to ``name`` as the splitter hands it to the tool parser."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name}{MESSAGE}"


def held_suffix(text: str) -> int:
    """Length of the suffix of ``text`` that may be the start of a special token."""
    m = _PARTIAL.search(text)
    return len(text) - m.start() if m else 0


class HarmonySplitter:
    """One output's harmony text, fed delta by delta: ``feed`` returns the new (reasoning,
    content) text, each None when empty. ``specials``: the tokenizer's special tokens (any
    other ``<|...|>`` text is the model's words). ``calls``: function calls go to the content in
    canonical form for the tool parser; ``forced``: a forced call's grammar shaped the call's
    body, which is the answer (its arguments go to the content as they are); otherwise calls are
    dropped."""

    def __init__(self, specials: frozenset[str], calls: bool, forced: bool = False) -> None:
        self.specials = specials | set(MARKERS)
        self.calls = calls
        self.forced = forced
        self.held = ""
        self.state = "opening"  # opening, header, body, plain
        self.kind = CONTENT  # the body's destination

    def feed(self, delta: str, final: bool) -> tuple[str | None, str | None]:
        self.held += delta
        out: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        while self._step(final, out):
            pass
        return "".join(out[REASONING]) or None, "".join(out[CONTENT]) or None

    def _step(self, final: bool, out: dict[str, list[str]]) -> bool:
        """Consume what can be decided of ``held``; True to go again."""
        text = self.held
        if self.state == "opening":
            if not text:
                return False
            if text.startswith("<|"):
                self.state = "header"
            elif "<|".startswith(text) and not final:
                return False
            else:
                self.state = "plain"  # no harmony framing: all content
            return True
        if self.state == "plain":
            keep = 0 if final else held_suffix(text)
            out[CONTENT].append(self._strip(text[:len(text) - keep]))
            self.held = text[len(text) - keep:]
            return False
        if self.state == "header":
            at = text.find(MESSAGE)
            if at < 0:
                if final:
                    self.held = ""  # a header cut short: nothing of it is anyone's text
                return False
            header = parse_header(text[:at])
            self.kind = header.kind
            if self.kind == TOOL and self.forced:
                self.kind = CONTENT  # the grammar's answer: the arguments (or calls) themselves
            elif self.kind == TOOL:
                if self.calls:
                    out[CONTENT].append(call_header(header.recipient[len(FUNCTIONS):]))  # type: ignore[index]
                else:
                    self.kind = DROP
            self.held, self.state = text[at + len(MESSAGE):], "body"
            return True
        return self._body(text, final, out)

    def _body(self, text: str, final: bool, out: dict[str, list[str]]) -> bool:
        at, marker = self._next_special(text)
        while at >= 0 and marker not in BODY_ENDS and marker != START:
            # A stray special token inside a body: dropped, the body goes on.
            self._emit(out, text[:at])
            text = text[at + len(marker):]
            at, marker = self._next_special(text)
        if at >= 0:
            self._emit(out, text[:at])
            if self.kind == TOOL:
                out[CONTENT].append(CALL)
            # <|start|> with no end before it still opens the next message.
            self.held = text[at + len(marker):] if marker != START else text[at:]
            self.state = "header"
            return True
        keep = 0 if final else held_suffix(text)
        self._emit(out, text[:len(text) - keep])
        self.held = text[len(text) - keep:]
        return False

    def _next_special(self, text: str) -> tuple[int, str]:
        """Where the first special token in ``text`` is, and which (-1 if none)."""
        for m in _SPECIAL.finditer(text):
            if m.group(0) in self.specials:
                return m.start(), m.group(0)
        return -1, ""

    def _emit(self, out: dict[str, list[str]], text: str) -> None:
        if not text or self.kind == DROP:
            return
        out[REASONING if self.kind == REASONING else CONTENT].append(text)

    def _strip(self, text: str) -> str:
        return _SPECIAL.sub(lambda m: "" if m.group(0) in self.specials else m.group(0), text)
