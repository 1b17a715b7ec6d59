"""Generated JSON schemas for structured-output tests: nested objects, bounded arrays, enums,
numeric ranges, required and optional fields, ``$defs`` references. Every schema bounds its
output (string lengths, array sizes, integer ranges, closed objects), so a random-weight model
under the grammar must finish with a complete document well within ``max_tokens``."""
from __future__ import annotations

import random
from typing import Any

WORDS = ["id", "name", "tags", "size", "kind", "count", "owner", "meta", "ok", "score", "items", "note",
         "level", "color", "flag", "ratio", "child", "parts", "x", "y"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    pick = rng.randrange(7)
    if pick == 0:
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if pick == 1:
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if pick == 2:
        low = rng.choice([-1, 0, 0.5, 2])
        # multipleOf bounds the decimals (a JSON number may otherwise have endless digits).
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 10, 100]),
                "multipleOf": rng.choice([0.25, 0.5, 1])}
    if pick == 3:
        return {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "é", "1", "none"], rng.randint(1, 4))}
    if pick == 4:
        return {"type": "boolean"}
    if pick == 5:
        return {"type": "string", "enum": rng.sample(["north", "south", "east", "west"], 2)}
    return {"type": "string", "pattern": "^[a-z]{1,4}[0-9]{0,2}$"}


def _node(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    roll = rng.random()
    if depth <= 0 or roll < 0.45:
        if defs and rng.random() < 0.25:
            return {"$ref": f"#/$defs/{rng.choice(sorted(defs))}"}
        return _leaf(rng)
    if roll < 0.7:
        low = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth - 1, defs), "minItems": low,
                "maxItems": low + rng.randint(0, 3)}
    return _object(rng, depth - 1, defs)


def _object(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {name: _node(rng, depth, defs) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_schemas(count: int, seed: int = 0, max_depth: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        defs: dict[str, Any] = {}
        if rng.random() < 0.4:
            defs = {f"d{i}": _object(rng, 1, {}) for i in range(rng.randint(1, 2))}
        schema = _object(rng, rng.randint(1, max_depth), defs)
        if defs:
            schema["$defs"] = defs
        out.append(schema)
    return out
