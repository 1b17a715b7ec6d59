"""Every C++ CPU kernel is in cpu_build.KERNEL_MODULES, so the test session (and any process that
builds them ahead of time) compiles all of them before first use."""
from __future__ import annotations

import re
from pathlib import Path

import pagoda
from pagoda.layers import cpu_build


def test_kernel_registry_lists_every_inline_kernel() -> None:
    root = Path(pagoda.__file__).resolve().parent
    defining = set()
    for path in root.rglob("*.py"):
        if path.name != "cpu_build.py" and re.search(r"^_KERNEL = InlineKernel\(", path.read_text(), re.M):
            defining.add(".".join(("pagoda",) + path.relative_to(root).with_suffix("").parts))
    assert defining, "no kernel modules found: the scan is broken"
    assert defining == set(cpu_build.KERNEL_MODULES)
