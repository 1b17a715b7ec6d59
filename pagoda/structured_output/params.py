"""What a request asks its output to match (vLLM's ``StructuredOutputsParams``). Pure Python:
the sampling parameters carry it to the engine core, where a grammar backend compiles it.

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of the given strings) or ``grammar`` (a Lark grammar; the
``xgrammar`` backend takes EBNF/GBNF) is set. ``key()`` names the compiled grammar in caches.
``start_after_token_id`` delays the constraint until that token has been generated (a reasoning
model's end-of-thinking token: the grammar shapes the answer, not the reasoning before it);
``start_skip_after`` lets occurrences of it that follow given token sequences pass (gpt-oss's
harmony: the grammar starts at the first message body that is not the analysis channel's).
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Sequence

from pagoda.errors import check

# A schema, grammar, regex or list of choices larger than this is refused before anything
# compiles it.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """The constraint on a request's output; invalid shapes raise ``ParamError`` naming
    ``structured_outputs``. Whether the backend supports the schema is checked when the front end
    validates the request (``GrammarBackend.validate``)."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Allow whitespace between JSON tokens (the JSON is still valid; off keeps it compact and
    # stops an unhelpful model from filling max_tokens with blanks).
    whitespace_flexible: bool = False
    # Generate freely until this token id appears in the output; the grammar applies from the
    # token after it (None: from the first token). Not part of ``key()``: same grammar.
    start_after_token_id: int | None = None
    # An occurrence of ``start_after_token_id`` right after one of these token sequences does not
    # start the grammar (harmony's ``<|channel|>analysis`` before ``<|message|>``). Not in ``key()``.
    start_skip_after: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        check(len(set_kinds) == 1, "structured_outputs",
              "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; got "
              + (", ".join(set_kinds) if set_kinds else "none"))
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as exc:
                check(False, "structured_outputs", f"structured_outputs.json is not valid JSON: {exc}")
        if self.json is not None:
            check(isinstance(self.json, (dict, bool)), "structured_outputs",
                  "structured_outputs.json must be a JSON schema (an object)")
            check(len(_json.dumps(self.json)) <= MAX_SPEC_CHARS, "structured_outputs",
                  f"the JSON schema is longer than {MAX_SPEC_CHARS} characters")
        check(self.json_object in (None, True, False), "structured_outputs", "json_object must be a boolean")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                check(isinstance(value, str) and value != "", "structured_outputs",
                      f"structured_outputs.{name} must be a non-empty string")
                check(len(value) <= MAX_SPEC_CHARS, "structured_outputs",
                      f"structured_outputs.{name} is longer than {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            check(isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
                  and all(isinstance(c, str) and c for c in self.choice), "structured_outputs",
                  f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            check(sum(len(c) for c in self.choice) <= MAX_SPEC_CHARS, "structured_outputs",
                  f"structured_outputs.choice holds more than {MAX_SPEC_CHARS} characters in all")
            self.choice = list(self.choice)
        check(isinstance(self.whitespace_flexible, bool), "structured_outputs",
              "whitespace_flexible must be a boolean")
        check(self.start_after_token_id is None or (type(self.start_after_token_id) is int
                                                    and self.start_after_token_id >= 0),
              "structured_outputs", "start_after_token_id must be a token id (an integer >= 0) or None")
        skip = self.start_skip_after
        check(skip is None or (isinstance(skip, (list, tuple)) and len(skip) <= 16 and all(
            isinstance(seq, (list, tuple)) and 0 < len(seq) <= 64
            and all(type(t) is int and t >= 0 for t in seq) for seq in skip)), "structured_outputs",
              "start_skip_after must be a list of up to 16 non-empty token id lists")
        if skip is not None:
            self.start_skip_after = [list(seq) for seq in skip]

    def grammar_start(self, output: Sequence[int]) -> int | None:
        """Where in ``output`` the grammar starts applying: 0 with no start token; after the
        first ``start_after_token_id`` not right after a ``start_skip_after`` sequence; None while
        there is none yet."""
        start = self.start_after_token_id
        if start is None:
            return 0
        for i, token in enumerate(output):
            if token == start and not any(i >= len(p) and list(output[i - len(p):i]) == p
                                          for p in self.start_skip_after or ()):
                return i + 1
        return None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> Any:
        """The constraint itself (a schema dict, a regex, a list of choices, grammar text)."""
        return {"type": "object"} if self.kind == "json_object" else getattr(self, self.kind)

    def key(self) -> str:
        """A canonical name of the constraint: equal keys compile to the same grammar."""
        return _json.dumps([self.kind, self.spec(), self.whitespace_flexible], sort_keys=True,
                           separators=(",", ":"))

    @staticmethod
    def coerce(value: Any) -> "StructuredOutputsParams | None":
        """A ``StructuredOutputsParams`` from itself or a dict of its fields (None stays None)."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        check(isinstance(value, dict), "structured_outputs",
              "structured_outputs must be a StructuredOutputsParams or a dict of its fields")
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        check(not unknown, "structured_outputs", f"structured_outputs has unknown fields {unknown}")
        return StructuredOutputsParams(**value)
