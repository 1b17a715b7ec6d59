"""The kernel library's op table (csrc/bindings.cpp): every variant this CPU runs registers exactly
the ops of ``build.OP_SCHEMAS``, each with its schema, in a namespace of its own (so the variants
load side by side), the greedy round is a custom class made by an op, and a kernel called through
the table runs without the GIL (``--async-scheduling`` relies on it)."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from pagoda.kernels import build, select

VARIANTS = select.supported_variants()
pytestmark = pytest.mark.skipif(not select.kernels_enabled(), reason="PAGODA_CPU_KERNELS=0")


def _table(variant: str):
    table = build.library(variant)
    assert table is not None, f"the {variant} kernel library is missing or failed to build (see the log)"
    return table


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_registers_every_op_with_its_schema_and_nothing_else(variant):
    table = _table(variant)
    assert build.schema_problems(table.name) == []
    registered = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
                  if s.name.startswith(table.name + "::")}
    assert registered == set(build.OP_SCHEMAS)


def test_the_variants_load_side_by_side_under_their_own_namespaces():
    names = [_table(v).name for v in VARIANTS]
    assert len(set(names)) == len(names)
    assert [build.variant_of(_table(v)) for v in VARIANTS] == VARIANTS


def test_a_schema_check_names_what_differs():
    """``schema_problems`` fails for a namespace without the ops (what the container build and
    ``check_installed`` rely on)."""
    problems = build.schema_problems("pagoda_no_such_variant")
    assert len(problems) == len(build.OP_SCHEMAS) and problems[0] == "no gemv"


def test_the_greedy_round_is_a_custom_class_made_by_an_op():
    table = _table(VARIANTS[-1])
    ids, positions = torch.tensor([3, 4]), torch.tensor([5, 9])
    ctx, lens = torch.tensor([5, 9], dtype=torch.int32), torch.tensor([6, 10], dtype=torch.int32)
    slots, tables = torch.tensor([5, 9]), torch.arange(8, dtype=torch.int32).view(2, 4)
    rnd = table.greedy_round(ids, positions, ctx, lens, slots, tables, 4, None, [[7], []], 3)
    assert isinstance(rnd, torch.ScriptObject) and rnd.x.numel() == 0  # no embedding table: no rows
    logits = torch.zeros(2, 10)
    logits[0, 7] = logits[1, 2] = 1.0
    assert not rnd.step(logits, True)  # row 1 has no ending token
    assert ids.tolist() == [7, 2] and positions.tolist() == [6, 10] and lens.tolist() == [7, 11]
    assert rnd.tokens() == [[7], [2]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_kernel_called_through_the_op_table_releases_the_gil(variant):
    """Another thread runs while the kernel does. The interpreter is told to switch threads only
    every 100 s, so the waiting thread gets the GIL within the calls only if a call releases it:
    without the release the flag stays unset (deterministically), with it the thread runs as soon
    as the OS schedules it."""
    table = _table(variant)
    w, x = torch.randn(1024, 1024), torch.randn(4, 1024)
    go, ran = threading.Event(), []
    waiter = threading.Thread(target=lambda: (go.wait(), ran.append(True)))
    waiter.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        go.set()
        for _ in range(5000):
            table.gemv(x, w)
            if ran:
                break
    finally:
        sys.setswitchinterval(interval)
        waiter.join()
    assert ran, "the other thread never ran during the kernel calls: the GIL was held"
