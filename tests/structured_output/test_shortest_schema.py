"""Finite but too long: the least text length of a JSON schema or a regex (``shortest_schema.py``),
its bound on hostile input, and the front end's refusal of a constraint whose shortest text is
longer than the context (``validate._probe``) or than the request's budget (``LLM.generate``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pagoda import SamplingParams
from pagoda.structured_output import StructuredOutputsParams as SO
from pagoda.structured_output.shortest_schema import MAX_UNITS, regex_shortest_chars, schema_shortest_bytes
from pagoda.structured_output.validate import _probe, _worker_backend

_X = {"anyOf": [{"$ref": "#/$defs/Y"}, {"type": "null"}]}
_Y = {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/X"}}}


def _compact(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")))


@pytest.mark.parametrize("schema, expected", [
    ({"type": "string", "minLength": 100_000}, 100_002),
    ({"type": "string", "pattern": "^[a-z]{5}$", "minLength": 2}, 7),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 100_000}, 2 * 100_000 + 1),
    ({"type": "array", "prefixItems": [{"type": "string", "minLength": 3}], "items": {"type": "boolean"},
      "minItems": 3}, _compact(["abc", True, True])),
    ({"type": "array", "items": [{"const": "ab"}], "additionalItems": {"type": "null"}, "minItems": 2},
     _compact(["ab", None])),
    ({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "required": ["b"], "properties": {"b": {"type": "string", "minLength": 5}}}}},
     _compact({"a": {"b": "xxxxx"}})),
    ({"type": "object", "required": ["é"], "additionalProperties": {"type": "boolean"}}, len('{"é":true}'.encode())),
    ({"allOf": [{"type": "string", "minLength": 10}, {"type": "string", "minLength": 3}]}, 12),
    ({"anyOf": [{"type": "string", "minLength": 10}, {"type": "array", "minItems": 2}]}, 5),
    ({"type": ["string", "null"], "minLength": 50}, 4),
    ({"enum": ["abc", "de"]}, 4),
    ({"const": {"a": [1, 2]}}, _compact({"a": [1, 2]})),
    ({"type": "object"}, 2),
    ({}, 1),
    (True, 1),
    ({"unknownKeyword": 10 ** 9, "minLength": 10 ** 9}, 1),  # no type: a number is valid (1 byte)
    ({"$ref": "#"}, math.inf),
    ({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}, math.inf),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, math.inf),
    ({"type": "object", "required": ["a"], "properties": {"a": False}}, math.inf),
    # a cycle an alternative escapes is finite
    ({"type": "object", "required": ["a"], "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
     _compact({"a": None})),
    # ... even where the walk first meets the cycle from inside (Y before X settles)
    ({"type": "object", "required": ["x", "y"], "properties": {"x": {"$ref": "#/$defs/X"}, "y": {"$ref": "#/$defs/Y"}},
      "$defs": {"X": _X, "Y": _Y}}, _compact({"x": None, "y": {"x": None}})),
    ({"$ref": "https://example.com/schema"}, 1),  # not followed: any value
])
def test_schema_shortest_bytes(schema: object, expected: float) -> None:
    assert schema_shortest_bytes(schema) == expected


def test_refs_multiply_without_the_schema_growing() -> None:
    keys = [f"k{k:02d}" for k in range(20)]

    def level(inner: str) -> dict:
        return {"type": "object", "properties": {k: {"$ref": f"#/$defs/{inner}"} for k in keys}, "required": keys}

    schema = {"$defs": {"l1": level("l2"), "l2": level("leaf"), "leaf": {"type": "string", "minLength": 10}},
              **level("l1")}
    leaf = 12
    l2 = 2 + 20 * (6 + leaf) + 19
    l1 = 2 + 20 * (6 + l2) + 19
    assert schema_shortest_bytes(schema) == 2 + 20 * (6 + l1) + 19


def test_hostile_schemas_are_bounded_work() -> None:
    wide = {"type": "object", "required": [f"k{i}" for i in range(MAX_UNITS + 1)]}
    assert schema_shortest_bytes(wide) is None  # past the cap: no verdict, never a refusal
    assert schema_shortest_bytes({"enum": list(range(MAX_UNITS + 1))}) is None
    deep: object = {"type": "string"}
    for _ in range(3000):  # deeper than Python's recursion limit: the walk is iterative
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert schema_shortest_bytes(deep) == 2 + 3000 * 6
    deep_const: object = 1
    for _ in range(5000):
        deep_const = [deep_const]
    assert schema_shortest_bytes({"const": deep_const}) is None


@pytest.mark.parametrize("pattern, expected", [
    ("a{100000}", 100_000),
    ("(abc){50000}", 150_000),
    ("(a{1000}){1000}", 10 ** 6),
    (r"\d{3}-\d{4}", 8),
    ("[a-z]*x?", 0),
    ("(?:ab|c){2,}", 2),
    ("(a{100000}){100000}", 10 ** 10),  # multiplied, never expanded
    ("[[:alpha:]]{4}", None),  # Rust's nested class: Python would read another width
    (r"\p{L}+", None),
    ("(" * 5000 + ")" * 5000, None),
    ("a{99999999999}", None),
])
def test_regex_shortest_chars(pattern: str, expected: int | None) -> None:
    assert regex_shortest_chars(pattern) == expected


TOO_LONG = [SO(json={"type": "string", "minLength": 100_000}),
            SO(json={"type": "array", "items": {"type": "integer"}, "minItems": 100_000}),
            SO(json={"type": "object", "required": ["a"], "properties": {
                "a": {"type": "object", "required": ["b"], "properties": {"b": {"type": "string", "minLength": 5000}}}}}),
            SO(regex="(abc){400}"), SO(choice=["x" * 4000, "y" * 5000])]


def test_longer_than_the_context_is_refused_for_every_request(llama_dir: Path) -> None:
    worker = _worker_backend("guidance", str(llama_dir), 512, [0], 64)
    assert worker.longest_token_bytes >= 2
    for params in TOO_LONG:
        refusal = _probe(worker, params).refusal
        assert refusal is not None and "max_model_len 64" in refusal, (params, refusal)
    ordinary = [SO(json={"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                         "required": ["name", "age"]}), SO(regex=r"\d{3}-\d{4}"), SO(json={"type": "string", "minLength": 20})]
    for params in ordinary:
        verdict = _probe(worker, params)
        assert verdict.refusal is None and 1 <= verdict.min_tokens < 64, (params, verdict)
        assert verdict.min_tokens * worker.longest_token_bytes >= verdict.min_bytes


def test_longer_than_max_tokens_is_refused_for_that_request_alone(llama_llm) -> None:
    schema = SO(json={"type": "string", "minLength": 600})
    with pytest.raises(ValueError, match="max_tokens \\(8\\)"):
        llama_llm.generate("Hi", SamplingParams(max_tokens=8, structured_outputs=schema), use_tqdm=False)
    # The same constraint with room for it is not refused (it ends at max_tokens or with its text).
    out = llama_llm.generate("Hi", SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=schema),
                             use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("length", "stop")
    # An ordinary schema under a small max_tokens runs (truncated), as before.
    out = llama_llm.generate("Hi", SamplingParams(max_tokens=1, structured_outputs=SO(json={"type": "object"})),
                             use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
