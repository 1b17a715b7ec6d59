"""The ``bench`` extra: packages only ``pagoda bench`` uses (aiohttp, httpx, matplotlib),
which ``pagoda serve`` and the offline ``LLM`` never need. Bench modules reach them through
``lazy_import`` / ``bench_import``, so every bench command still lists and parses its flags
without them, and a run that needs a missing one stops with the command that installs it
(``MissingBenchExtra``; the CLI prints it) instead of a traceback.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

INSTALL = "pip install -e '.[bench]'"


class MissingBenchExtra(ImportError):
    """A package of the ``bench`` extra is not installed; the message says how to install it."""


def bench_import(name: str) -> ModuleType:
    """``importlib.import_module(name)``, or ``MissingBenchExtra`` naming the package."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        package = name.split(".")[0]
        raise MissingBenchExtra(f"this benchmark needs the {package!r} package, from pagoda's bench extra: "
                                f"{INSTALL} (from a checkout; pip install 'pagoda[bench]' otherwise)") from exc


class LazyModule:
    """A module-level stand-in for a bench-extra module: imported (``bench_import``) on the first
    attribute read, so importing the bench module itself never needs the package."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:  # only for names not set in __init__
        if self._module is None:
            self._module = bench_import(self._name)
        return getattr(self._module, attr)


def lazy_import(name: str) -> Any:
    """``LazyModule(name)``, typed loosely so annotations like ``aiohttp.ClientSession`` read as usual."""
    return LazyModule(name)
