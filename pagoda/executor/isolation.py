"""Per-row fault isolation for the batched steps after the forward pass (sampling, draft
verification): a row that makes the batched call raise is found and failed alone, and the other
rows still get their results in the same step.

Random draws are part of a result: a seeded request must draw the same numbers whether or not
a failing row shared its batch, so every generator involved is rewound before rows are re-run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


def describe(exc: BaseException) -> str:
    """The server-side message for a failed request."""
    return f"{type(exc).__name__}: {exc}"


class RngSnapshot:
    """The states of some CPU generators, to rewind them after a failed batched call."""

    def __init__(self, generators: list[torch.Generator | None]) -> None:
        unique = {id(g): g for g in generators if g is not None and g.device.type == "cpu"}
        self._states = [(g, g.get_state()) for g in unique.values()]

    def restore(self) -> None:
        for gen, state in self._states:
            gen.set_state(state)


@dataclass
class RowResults(Generic[T]):
    """What ``run_rows`` got: ``chunks`` of (row indices, the call's result for those rows) and,
    per failed row, the exception."""

    chunks: list[tuple[list[int], T]] = field(default_factory=list)
    failed: dict[int, Exception] = field(default_factory=dict)


def run_rows(fn: Callable[[list[int]], T], num_rows: int, generators: list[torch.Generator | None],
             what: str) -> RowResults[T]:
    """``fn(all rows)`` once; if it raises, rewind ``generators`` and call ``fn([i])`` for each
    row, so only the rows that fail on their own are lost. ``fn`` must not modify shared state
    other than the generators' (it receives fresh copies of its inputs on each call)."""
    rows = list(range(num_rows))
    snapshot = RngSnapshot(generators)
    try:
        return RowResults([(rows, fn(rows))])
    except Exception:
        logger.warning("batched %s failed; retrying row by row to isolate the failing request", what,
                       exc_info=True)
    snapshot.restore()
    results: RowResults[T] = RowResults()
    for i in rows:
        try:
            results.chunks.append(([i], fn([i])))
        except Exception as exc:
            results.failed[i] = exc
    return results
