"""Constraints that can never end: the least text length of a grammar (``shortest.py``) and the
front end's refusal of constraints with no finite text, or with a shortest text longer than the
model's context, for both backends (``validate._probe``, called here without its sandbox)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagoda.structured_output import StructuredOutputsParams as SO
from pagoda.structured_output.shortest import ebnf_shortest_bytes, lark_shortest_bytes, shortest_bytes
from pagoda.structured_output.validate import _probe, _worker_backend

CHAIN = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(2999)) + 'r2999: "a"\n'


@pytest.mark.parametrize("grammar, expected", [
    ('start: "a" start', math.inf),
    ('start: ("a" | "b") start', math.inf),
    ('start: /[ab]/ start', math.inf),
    ('start: x\nx: "a" y\ny: "b" x', math.inf),
    ('start: x+ "c"\nx: "a" x', math.inf),
    ('start: "a".."z" start', math.inf),
    ('start: <|eos|> start', math.inf),
    ('start: x -> alias\nx: "q" x', math.inf),
    ('start: "a" start | "bc"', 2),
    ('start: x? "c"\nx: "a" x', 1),
    ('start: x* "c"\nx: "a" x', 1),
    ('start: [x] "c"\nx: x', 1),
    ('?start: "ab" ~ 3', 6),
    ('start: "a" ~ 3..5 b\nb: "bb" | c\nc: c', 5),
    ('%ignore /\\s+/\nstart: item+\nitem[lazy]: "x" | "(" start ")"', 1),
    ('%llguidance {}\nstart: "hello" %json {"type": "string"}', 5),
    ('start: A\nA: "a"+', 0),  # terminals count as 0 bytes: a lower bound
    (CHAIN, 3000),
])
def test_lark_shortest_bytes(grammar: str, expected: float) -> None:
    assert lark_shortest_bytes(grammar) == expected


def test_unreadable_grammar_gives_no_verdict() -> None:
    assert lark_shortest_bytes("start: foo{x}") is None
    assert lark_shortest_bytes('start: ("a"') is None
    assert ebnf_shortest_bytes("not a rule") is None


@pytest.mark.parametrize("grammar, expected", [
    ('root ::= (("a" root))', math.inf),
    ('root ::= ((root_1 root))\nroot_1 ::= (("a") | ("b"))', math.inf),
    ('root ::= (("a" root) | ("bc"))', 2),
    ('root ::= ((root_2{1000, 1000}))\nroot_1 ::= (("a"))\nroot_2 ::= ((root_1{1000, 1000}))', 10 ** 6),
    ('root ::= (("\\"" s))\ns ::= (("\\"") | ([^\\"\\\\] s)) (=([ \\n]* [,}\\]:]))', 2),
    ('root ::= ([a-z]* "x"+ "yz"?)', 1),
])
def test_ebnf_shortest_bytes(grammar: str, expected: float) -> None:
    assert ebnf_shortest_bytes(grammar) == expected


def test_knuth_takes_the_cheapest_alternative_and_counts_repeats() -> None:
    productions = [("s", 0, [("a", 2), ("b", 1)]), ("s", 50, []), ("a", 3, []), ("a", 1, [("b", 1)]),
                   ("b", 7, []), ("loop", 1, [("loop", 1)])]
    assert shortest_bytes(productions, "s") == 2 * 3 + 7
    assert shortest_bytes(productions, "loop") == math.inf
    assert shortest_bytes(productions, "undefined") == 0.0


ENDLESS = {
    "guidance": [SO(grammar='start: ("a" | "b") start'), SO(grammar='start: x+ "c"\nx: "a" x'),
                 SO(grammar='root ::= ("a" | "b") root')],  # GBNF, converted to Lark
    "xgrammar": [SO(grammar='root ::= ("a" | "b") root'),
                 SO(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                 SO(json={"$ref": "#"})],
}
FINE = {
    "guidance": [SO(grammar='start: "a" start | "b"'), SO(json={"type": "object"}), SO(regex="[a-z]{3}"),
                 SO(choice=["yes", "no"]), SO(grammar='root ::= "a" root | "b"')],
    "xgrammar": [SO(grammar='root ::= "a" root | "b"'), SO(json={"type": "object"}), SO(regex="[a-z]{3}"),
                 SO(choice=["yes", "no"]), SO(json_object=True)],
}


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_endless_and_too_long_constraints_are_refused(llama_dir: Path, backend: str) -> None:
    worker = _worker_backend(backend, str(llama_dir), 512, [0], 64)
    for params in ENDLESS[backend]:
        assert _probe(worker, params).refusal is not None, params
    for params in FINE[backend]:
        verdict = _probe(worker, params)
        assert verdict.refusal is None and 1 <= verdict.min_tokens <= 2, (params, verdict)
    if backend == "xgrammar":  # llguidance's lexer limit refuses this one first
        refusal = _probe(worker, SO(regex="(a{1000}){1000}")).refusal
        assert refusal is not None and "1000000 bytes" in refusal, refusal
