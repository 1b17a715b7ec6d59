"""Every C++ CPU kernel's wrapper is in build.KERNEL_MODULES, so the test session (and any process
that loads them ahead of time) has all of them before first use; and no C++ lives in a .py file."""
from __future__ import annotations

import re
from pathlib import Path

import pagoda
from pagoda.kernels import build as cpu_build


def test_kernel_registry_lists_every_inline_kernel() -> None:
    root = Path(pagoda.__file__).resolve().parent
    defining = set()
    for path in root.rglob("*.py"):
        if path.name != "build.py" and re.search(r"^_KERNEL = Kernel\(", path.read_text(), re.M):
            defining.add(".".join(("pagoda",) + path.relative_to(root).with_suffix("").parts))
    assert defining, "no kernel modules found: the scan is broken"
    assert defining == set(cpu_build.KERNEL_MODULES)


def test_no_cpp_in_python_sources() -> None:
    """The kernels' C++ lives in pagoda/kernels/csrc, not in Python strings."""
    root = Path(pagoda.__file__).resolve().parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if re.search(r"^\s*#include\s*[<\"]", p.read_text(), re.M)]
    assert not offenders, offenders
