"""A sequence's block table: the list of its KV block ids, with a C int32 copy kept in step.

Each step the model runner lays every scheduled sequence's table out as one row of an int32
tensor. Flattening Python lists into it cost time in proportion to the context (~40 ns per
block per sequence per step: ~5 us a sequence at 2k tokens, ~38 us at 16k on a 2-vCPU EPYC;
``pagoda bench block-tables``, figures in docs/benchmarks.md).
``BlockTable`` is a ``list`` for every reader (indexing, slices, ``len``, iteration, equality
with lists, ``repr``), so the KV manager, the scheduler and the tests read it as before; each
mutation also updates ``ints``, an ``array.array('i')`` of the same ids, so the step builder
copies a row with one C-level concatenation (``row += table.ints``) whatever its length.

Invariant: ``list(table.ints) == table`` after every operation. The common mutations (append,
item assignment, pop) update ``ints`` in place; the rare ones (slice assignment, sort, ...)
copy it again whole. ``copy()`` gives an independent table (a fork's).

Holders (``Sequence``, the draft model's ``DraftState``) keep it as a plain attribute, and the
KV manager assigns only ``BlockTable``s (``BlockTable()`` on free, ``copy()`` on fork); its
``check_invariants`` asserts that. No descriptor converts assignments: one that writes the
instance's ``__dict__`` makes CPython 3.11 give up the inline attribute values of that object,
and every other attribute read on the ``Sequence`` then cost about twice as much (measured: 22.1
-> 24.4 us a sequence step in ``pagoda bench host``). A plain list assigned by a test or a tool
still builds correctly: the builder converts it (``executor.input.table_rows``).
"""
from __future__ import annotations

from array import array
from typing import Any, Iterable, SupportsIndex


class BlockTable(list):
    """Block ids (a ``list[int]``) mirrored in ``ints`` (``array('i')``) for C-level copies."""

    __slots__ = ("ints",)

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        super().__init__(blocks)
        self.ints = array("i", self)

    # ---- the mutations a block table sees: in place in both -----------------------------
    def append(self, block: int) -> None:
        self.ints.append(block)  # first: an id int32 cannot hold fails before the list changes
        list.append(self, block)

    def __setitem__(self, index: Any, value: Any) -> None:
        if type(index) is int:
            self.ints[index] = value
            list.__setitem__(self, index, value)
            return
        list.__setitem__(self, index, value)
        self._resync()

    def pop(self, index: SupportsIndex = -1) -> int:
        block = list.pop(self, index)
        self.ints.pop(index)
        return block

    def clear(self) -> None:
        list.clear(self)
        del self.ints[:]

    def extend(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)  # (an iterator is read once, for both)
        added = array("i", blocks)
        list.extend(self, blocks)
        self.ints += added

    def __iadd__(self, blocks: Iterable[int]) -> "BlockTable":  # type: ignore[override]
        self.extend(blocks)
        return self

    def insert(self, index: SupportsIndex, block: int) -> None:
        self.ints.insert(index, block)
        list.insert(self, index, block)

    def __delitem__(self, index: Any) -> None:
        list.__delitem__(self, index)
        del self.ints[index]

    # ---- rare ones: the list changes, then ``ints`` is copied again ----------------------
    def remove(self, block: int) -> None:
        list.remove(self, block)
        self._resync()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        list.sort(self, *args, **kwargs)
        self._resync()

    def reverse(self) -> None:
        list.reverse(self)
        self._resync()

    def __imul__(self, times: SupportsIndex) -> "BlockTable":  # type: ignore[override]
        list.__imul__(self, times)
        self._resync()
        return self

    def _resync(self) -> None:
        self.ints = array("i", self)

    # ---- copies --------------------------------------------------------------------------
    def copy(self) -> "BlockTable":  # type: ignore[override]
        return BlockTable(self)

    __copy__ = copy

    def __reduce__(self) -> tuple:
        # pickle/deepcopy: rebuilt from its ids (the default would append before ``ints`` exists).
        return BlockTable, (list(self),)
