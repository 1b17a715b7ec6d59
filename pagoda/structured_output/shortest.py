"""The fewest bytes a grammar's text can have: infinite for a grammar that never ends.

A constraint whose every derivation recurses forever (``start: ("a" | "b") start``) or whose
shortest text is longer than any response of the server (``(a{1000}){1000}``) compiles, follows
token after token, and could only ever finish with ``length``. Neither llguidance nor xgrammar
says so, so the front end's check (``validate.py``, in its sandbox) asks this module, over the
grammar as text: llguidance's Lark for ``grammar`` constraints, and for xgrammar the EBNF it
prints for any compiled constraint (``str(xgrammar.Grammar)``).

The grammar becomes plain productions (groups become fresh rules; ``?``, ``*``, ``[...]`` and
zero repeats drop out; ``+`` counts once, ``{m, n}`` and ``~ m..n`` count ``m`` times) and
Knuth's generalisation of Dijkstra's algorithm gives each rule its least length, in time linear
in the grammar's size (times a log). Lengths are lower bounds: a terminal this module does not
read (a regular expression, a named token, an embedded ``%json``) counts as 0 bytes, so a
grammar is never called longer than it is. Text this module cannot read gives None: no verdict.
"""
from __future__ import annotations

import heapq
import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

# A production: its rule, fixed bytes, and the rules it needs with how many times each.
Production = tuple[str, int, list[tuple[str, int]]]


class Unreadable(ValueError):
    """The grammar uses something this module does not read: no verdict."""


def shortest_bytes(productions: list[Production], start: str, maxima: frozenset[str] = frozenset()) -> float:
    """Least byte length of a text ``start`` derives (``math.inf``: none is finite). A rule
    with no production is a terminal of unknown length: 0. A production of a rule in ``maxima``
    is the most of its fixed bytes and its needs (each a bound on the same text), not their sum."""
    defined = {lhs for lhs, _, _ in productions}
    best: dict[str, float] = {}
    waiting: list[int] = []  # per production: needed rules not yet settled (with repeats)
    partial: list[int] = []  # per production: bytes so far
    users: dict[str, list[tuple[int, int]]] = {}  # rule -> (production, times)
    heap: list[tuple[int, str]] = []
    for i, (lhs, fixed, needs) in enumerate(productions):
        open_needs = [(name, times) for name, times in needs if times > 0 and name in defined]
        waiting.append(len(open_needs))
        partial.append(fixed)
        for name, times in open_needs:
            users.setdefault(name, []).append((i, times))
        if not open_needs:
            heapq.heappush(heap, (fixed, lhs))
    while heap:
        length, name = heapq.heappop(heap)
        if name in best:
            continue
        best[name] = length
        for i, times in users.get(name, ()):
            if productions[i][0] in maxima:
                partial[i] = max(partial[i], times * length)
            else:
                partial[i] += times * length
            waiting[i] -= 1
            if waiting[i] == 0:
                heapq.heappush(heap, (partial[i], productions[i][0]))
    if start not in defined:
        return 0.0
    return best.get(start, math.inf)


# ---- reading grammars -----------------------------------------------------------------------

@dataclass
class _Builder:
    """Turns parsed rule bodies into productions, naming groups ``rule#k``."""
    productions: list[Production] = field(default_factory=list)
    groups: int = 0

    def group(self, owner: str, alternatives: list[tuple[int, list[tuple[str, int]]]]) -> str:
        self.groups += 1
        name = f"{owner}#{self.groups}"
        self.add(name, alternatives)
        return name

    def add(self, name: str, alternatives: list[tuple[int, list[tuple[str, int]]]]) -> None:
        self.productions.extend((name, fixed, needs) for fixed, needs in alternatives)


class _Tokens:
    def __init__(self, items: list[tuple[str, str, int]]) -> None:
        self.items, self.i = items, 0

    def peek(self, ahead: int = 0) -> tuple[str, str, int]:
        j = self.i + ahead
        return self.items[j] if j < len(self.items) else ("end", "", 0)

    def take(self) -> tuple[str, str, int]:
        item = self.peek()
        self.i += 1
        return item


def _parse_alternatives(tokens: _Tokens, owner: str, builder: _Builder, stop: set[str],
                        is_terminal: Callable[[str], bool]) -> list[tuple[int, list[tuple[str, int]]]]:
    """``alt ('|' alt)*`` up to a token kind in ``stop`` (not taken)."""
    alternatives = [_parse_sequence(tokens, owner, builder, stop | {"|"}, is_terminal)]
    while tokens.peek()[0] == "|":
        tokens.take()
        alternatives.append(_parse_sequence(tokens, owner, builder, stop | {"|"}, is_terminal))
    return alternatives


def _parse_sequence(tokens: _Tokens, owner: str, builder: _Builder, stop: set[str],
                    is_terminal: Callable[[str], bool]) -> tuple[int, list[tuple[str, int]]]:
    fixed, needs = 0, []
    while tokens.peek()[0] not in stop:
        kind, text, minimum = tokens.take()
        if kind == "name":
            atom: tuple[int, str | None] = (0, None if is_terminal(text) else text)
        elif kind == "literal":
            atom = (minimum, None)
        elif kind in ("(", "["):
            close = ")" if kind == "(" else "]"
            inner = _parse_alternatives(tokens, owner, builder, {close, "end"}, is_terminal)
            if tokens.take()[0] != close:
                raise Unreadable(f"unclosed {kind}")
            atom = (0, builder.group(owner, inner))
            if kind == "[":  # Lark's optional group
                atom = (0, None)
        else:
            raise Unreadable(f"unexpected {text!r}")
        times = 1
        while tokens.peek()[0] == "repeat":
            times *= tokens.take()[2]
        fixed += times * atom[0]
        if atom[1] is not None and times:
            needs.append((atom[1], times))
    return fixed, needs


# Lark (llguidance's dialect) ------------------------------------------------------------------

_LARK_TOKEN = re.compile(r"""
    (?P<space>\s+|//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><\[[0-9,\s\-]*\]>|<\|[^|>\n]*\|>)
  | (?P<directive>%[a-z_]+)
  | (?P<repeat>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<name>(?m:^)[?!][A-Za-z_][A-Za-z_0-9]*|[A-Za-z_][A-Za-z_0-9]*)
  | (?P<priority>\.-?\d+)
  | (?P<range>\.\.)
  | (?P<alias>->)
  | (?P<op>[|()\[\]?*+:,=])
""", re.VERBOSE)


def _lark_tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, number) tokens; ``%json {...}`` and the like become one literal."""
    out: list[tuple[str, str, int]] = []
    pos = 0
    decoder = json.JSONDecoder()
    while pos < len(text):
        m = _LARK_TOKEN.match(text, pos)
        if m is None:
            raise Unreadable(f"unexpected character {text[pos]!r}")
        pos = m.end()
        kind = m.lastgroup
        value = m.group()
        if kind == "space":
            continue
        if kind == "string":
            out.append(("literal", value, _string_bytes(value)))
        elif kind in ("regex", "special"):
            out.append(("literal", value, 0))
        elif kind == "directive":
            rest = text[pos:].lstrip()
            if rest.startswith("{"):  # %json {...}, %llguidance {...}: a JSON value
                _, used = decoder.raw_decode(rest)
                pos = len(text) - len(rest) + used
            elif value not in ("%json", "%regex"):  # %ignore, %import ...: the rest of the line
                end = text.find("\n", pos)
                pos = len(text) if end < 0 else end
            out.append(("directive", value, 0))
        elif kind == "repeat":
            out.append(("repeat", value, int(re.findall(r"\d+", value)[0])))
        elif kind == "op" and value in "?*":
            out.append(("repeat", value, 0))
        elif kind == "op" and value == "+":
            out.append(("repeat", value, 1))
        elif kind == "op":
            out.append((value, value, 0))
        else:
            out.append((kind, value, 0))
    return out


def _string_bytes(token: str) -> int:
    body = token[:-1] if token.endswith("i") else token
    try:
        return len(json.loads(body).encode("utf-8"))
    except (ValueError, UnicodeEncodeError):
        return 0  # an escape JSON does not know: no bytes claimed


def _lark_is_terminal(name: str) -> bool:
    bare = name.lstrip("_?!")
    return not bare or bare[0].isupper()


def _lark_definition(tokens: list[tuple[str, str, int]], i: int) -> int | None:
    """If a definition (``name[attrs].prio:``) starts at ``i``, the index after its colon."""
    if tokens[i][0] != "name":
        return None
    j = i + 1
    if j < len(tokens) and tokens[j][0] == "[":
        while j < len(tokens) and tokens[j][0] != "]":
            j += 1
        j += 1
    if j < len(tokens) and tokens[j][0] == "priority":
        j += 1
    return j + 1 if j < len(tokens) and tokens[j][0] == ":" else None


def lark_shortest_bytes(text: str, start: str = "start") -> float | None:
    """Least bytes of a text of the Lark grammar ``text`` (``math.inf``: no finite one), or
    None if this module cannot read it."""
    try:
        tokens = _lark_tokens(text)
        builder = _Builder()
        for name, body in _lark_statements(tokens):
            if _lark_is_terminal(name):
                continue  # terminals cannot recurse: whatever they match is finite
            stream = _Tokens(body)
            alternatives = _parse_alternatives(stream, name, builder, {"end"}, _lark_is_terminal)
            builder.add(name, alternatives)
        return shortest_bytes(builder.productions, start)
    except (Unreadable, ValueError, IndexError, RecursionError):
        return None


def _lark_statements(tokens: list[tuple[str, str, int]]) -> list[tuple[str, list[tuple[str, str, int]]]]:
    """(rule name, body tokens) of each definition; directives and aliases dropped."""
    out: list[tuple[str, list[tuple[str, str, int]]]] = []
    i = 0
    current: list[tuple[str, str, int]] | None = None
    while i < len(tokens):
        after = _lark_definition(tokens, i)
        if after is not None:
            current = []
            out.append((tokens[i][1].lstrip("?!"), current))
            i = after
            continue
        kind = tokens[i][0]
        if kind == "directive" and tokens[i][1] in ("%json", "%regex"):
            if current is None:
                raise Unreadable("a value outside any rule")
            current.append(("literal", tokens[i][1], 0))
        elif kind == "directive":  # %ignore, %import, %llguidance ...: the rest is not a rule body
            current = None
        elif kind == "alias":
            i += 1  # and its name
        elif kind == "range":  # "a".."z": one character, already counted by the first literal
            i += 1
        elif current is not None:
            current.append(tokens[i])
        elif kind not in ("literal", "name", "|"):
            raise Unreadable(f"unexpected {tokens[i][1]!r}")
        i += 1
    return out


# xgrammar's EBNF (as ``str(xgrammar.Grammar)`` prints it: one rule a line) ----------------------

_EBNF_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<charclass>\[(?:[^\]\\]|\\.)*\])
  | (?P<lookahead>\(=)
  | (?P<repeat>\{\s*\d+\s*(?:,\s*-?\d*\s*)?\})
  | (?P<name>[A-Za-z_][A-Za-z_0-9\-.]*)
  | (?P<op>[|()?*+])
""", re.VERBOSE)


def _ebnf_tokens(body: str) -> list[tuple[str, str, int]]:
    out: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(body):
        m = _EBNF_TOKEN.match(body, pos)
        if m is None:
            raise Unreadable(f"unexpected character {body[pos]!r}")
        pos = m.end()
        kind, value = m.lastgroup, m.group()
        if kind == "space":
            continue
        if kind == "lookahead":  # (=...) matches nothing: skip to its closing parenthesis
            depth = 1
            while depth:
                m = _EBNF_TOKEN.match(body, pos)
                if m is None:
                    raise Unreadable("unreadable lookahead")
                pos = m.end()
                depth += {"(": 1, ")": -1, "(=": 1}.get(m.group(), 0)
            continue
        if kind == "string":
            out.append(("literal", value, _string_bytes(value)))
        elif kind == "charclass":
            out.append(("literal", value, 1))
        elif kind == "repeat":
            out.append(("repeat", value, int(re.findall(r"\d+", value)[0])))
        elif value in "?*":
            out.append(("repeat", value, 0))
        elif value == "+":
            out.append(("repeat", value, 1))
        elif kind == "op":
            out.append((value, value, 0))
        else:
            out.append(("name", value, 0))
    return out


def ebnf_shortest_bytes(text: str, start: str = "root") -> float | None:
    """Least bytes of a text of the EBNF grammar ``text``, one ``name ::= body`` a line
    (``math.inf``: no finite one), or None if this module cannot read it."""
    try:
        builder = _Builder()
        for line in text.splitlines():
            if not line.strip():
                continue
            name, sep, body = line.partition(" ::= ")
            if not sep:
                raise Unreadable(f"not a rule: {line[:40]!r}")
            stream = _Tokens(_ebnf_tokens(body))
            builder.add(name.strip(), _parse_alternatives(stream, name.strip(), builder, {"end"}, lambda _: False))
        return shortest_bytes(builder.productions, start)
    except (Unreadable, ValueError, IndexError, RecursionError):
        return None
