"""The fewest bytes a JSON schema's or a regular expression's text can have, as a lower bound.

``shortest.py`` reads grammars; this module gives the same lower bound for the constraints
llguidance compiles from a schema or a regex, which it prints as no grammar this project reads.
A constraint whose shortest text is finite but long (``{"type": "string", "minLength": 100000}``,
``"minItems": 100000``, ``a{100000}``) follows token after token and could only end with
``length``; the front end refuses it up front when the bound exceeds the request's budget.

A schema becomes productions for ``shortest.shortest_bytes``: each schema object is a rule; a
string is at least ``minLength`` characters (and its ``pattern``'s width) plus 2 quotes, a number
1 byte, ``true``/``null`` 4; an array ``minItems`` items with separators; an object its
``required`` properties with their keys, ``:`` and separators (compact JSON: any whitespace only
adds); ``anyOf``/``oneOf``/several ``type``s are alternatives (the least wins); ``allOf``, a
``$ref`` beside other keywords, ``enum``/``const`` beside a ``type`` are all true of the same
value (the most wins); a ``$ref`` is a rule reference, so a cycle through required properties is
infinite while one that an alternative escapes is not. Keywords this module does not read add
nothing, so the bound never exceeds the truth. The work is bounded (``MAX_UNITS``): past it, and
for input it cannot read, the answer is None (no verdict), never a refusal.
"""
from __future__ import annotations

import json
import warnings
from typing import Any

from pagoda.structured_output.shortest import Production, shortest_bytes

try:
    import re._parser as _sre_parse  # Python 3.11+
except ImportError:  # pragma: no cover - older Pythons
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# Schema objects, required properties, items and enum values one walk may visit before it gives
# up (a schema is at most 256 KiB of text: ``params.MAX_SPEC_CHARS``).
MAX_UNITS = 20_000
_ANY, _NEVER = "any", "never"  # any JSON value (at least 1 byte); no value at all


class _TooBig(Exception):
    """The walk passed ``MAX_UNITS``: no verdict."""


def regex_shortest_chars(pattern: str) -> int | None:
    """The fewest characters (so bytes) a full match of ``pattern`` has, read by Python's own
    regex parser; None where Python reads the pattern differently from llguidance's (a nested
    class such as ``[[:alpha:]]``, an escape Python lacks) or cannot read it at all."""
    if not isinstance(pattern, str):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "possible nested set": Rust's syntax, not Python's
        try:
            return int(_sre_parse.parse(pattern).getwidth()[0])
        except (Exception, RecursionError):  # re.error, OverflowError, FutureWarning, ...
            return None


def value_bytes(value: Any, budget: list[int]) -> int:
    """Least bytes of the compact JSON of ``value`` (a number counts 1: its spelling may vary)."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig
    if isinstance(value, str):
        return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if value is None or value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, (int, float)):
        return 1
    if isinstance(value, list):
        return 2 + sum(value_bytes(v, budget) for v in value) + max(0, len(value) - 1)
    if isinstance(value, dict):
        inner = sum(value_bytes(str(k), budget) + 1 + value_bytes(v, budget) for k, v in value.items())
        return 2 + inner + max(0, len(value) - 1)
    return 1


class _SchemaWalk:
    """Turns one schema into productions: rule ``s<id>`` per schema object met."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.budget = [MAX_UNITS]
        self.productions: list[Production] = [(_ANY, 1, []), (_NEVER, 0, [(_NEVER, 1)])]
        self.maxima: set[str] = set()
        self.named: dict[int, str] = {}
        self.todo: list[tuple[str, dict]] = []
        self.parts = 0

    def spend(self, units: int = 1) -> None:
        self.budget[0] -= units
        if self.budget[0] < 0:
            raise _TooBig

    def rule(self, schema: Any) -> str:
        """The rule of ``schema`` (queued for reading the first time it is met)."""
        if schema is True or (isinstance(schema, dict) and not schema):
            return _ANY
        if schema is False:
            return _NEVER
        if not isinstance(schema, dict):
            return _ANY
        name = self.named.get(id(schema))
        if name is None:
            self.spend()
            name = self.named[id(schema)] = f"s{len(self.named)}"
            self.todo.append((name, schema))
        return name

    def run(self) -> float:
        start = self.rule(self.root)
        while self.todo:
            name, schema = self.todo.pop()
            self.read(name, schema)
        return shortest_bytes(self.productions, start, frozenset(self.maxima))

    def part(self, alternatives: list[tuple[int, list[tuple[str, int]]]]) -> str:
        """A fresh rule with these alternatives (an empty list: no value)."""
        self.parts += 1
        name = f"p{self.parts}"
        self.productions.extend((name, fixed, needs) for fixed, needs in alternatives)
        return name if alternatives else _NEVER

    def read(self, name: str, schema: dict) -> None:
        """``name``'s production: the most of every part that is true of its value."""
        parts = [self.typed(schema)]
        if "$ref" in schema:
            parts.append(self.rule(self.resolve(schema["$ref"])))
        for word in ("anyOf", "oneOf"):
            branches = schema.get(word)
            if isinstance(branches, list) and branches:
                self.spend(len(branches))
                parts.append(self.part([(0, [(self.rule(b), 1)]) for b in branches]))
        every = schema.get("allOf")
        if isinstance(every, list):
            self.spend(len(every))
            parts.extend(self.rule(sub) for sub in every)
        if "const" in schema:
            parts.append(self.part([(value_bytes(schema["const"], self.budget), [])]))
        if isinstance(schema.get("enum"), list):
            parts.append(self.part([(value_bytes(v, self.budget), []) for v in schema["enum"]]))
        parts = [p for p in parts if p is not None]
        self.maxima.add(name)
        self.productions.append((name, 0, [(p, 1) for p in parts] or [(_ANY, 1)]))

    def resolve(self, ref: Any) -> Any:
        """The schema a local ``$ref`` (``#``, ``#/$defs/x``) names; any other: any value."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return True
        node: Any = self.root
        for token in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return True
        return node

    def typed(self, schema: dict) -> str | None:
        """The part its ``type`` gives (several types: the least), or None without a ``type``."""
        kinds = schema.get("type")
        if isinstance(kinds, str):
            kinds = [kinds]
        if not isinstance(kinds, list) or not kinds:
            return None
        alternatives = [self.of_type(kind, schema) for kind in kinds if isinstance(kind, str)]
        return self.part(alternatives) if alternatives else None

    def of_type(self, kind: str, schema: dict) -> tuple[int, list[tuple[str, int]]]:
        if kind == "string":
            return 2 + max(_count(schema.get("minLength")), regex_shortest_chars(schema.get("pattern")) or 0), []
        if kind == "array":
            return self.array(schema)
        if kind == "object":
            return self.object(schema)
        return {"boolean": 4, "null": 4}.get(kind, 1), []  # number, integer, unknown: 1

    def array(self, schema: dict) -> tuple[int, list[tuple[str, int]]]:
        count = _count(schema.get("minItems"))
        prefix = schema.get("prefixItems")
        rest = schema.get("items", True)
        if isinstance(rest, list):  # the older spelling of prefixItems
            prefix, rest = rest, schema.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        self.spend(min(count, len(prefix)))
        needs = [(self.rule(item), 1) for item in prefix[:count]]
        if count > len(prefix):
            needs.append((self.rule(rest), count - len(prefix)))
        return 2 + max(0, count - 1), needs

    def object(self, schema: dict) -> tuple[int, list[tuple[str, int]]]:
        required = schema.get("required")
        keys = list(dict.fromkeys(k for k in required if isinstance(k, str))) if isinstance(required, list) else []
        self.spend(len(keys))
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties", True)
        fixed = 2 + max(0, len(keys) - 1)
        needs = []
        for key in keys:
            fixed += value_bytes(key, self.budget) + 1
            value = properties[key] if key in properties else (extra if isinstance(extra, dict) else True)
            needs.append((self.rule(value), 1))
        return fixed, needs


def _count(value: Any) -> int:
    """A ``minLength``/``minItems``: a non-negative integer, else 0 (the backend refuses it)."""
    return value if type(value) is int and value > 0 else 0


def schema_shortest_bytes(schema: Any) -> float | None:
    """Least bytes of a JSON text valid under ``schema`` (``math.inf``: none is finite), or None
    when the schema is too large to walk within ``MAX_UNITS`` or cannot be read."""
    try:
        return _SchemaWalk(schema).run()
    except (_TooBig, RecursionError, ValueError, TypeError):
        return None
