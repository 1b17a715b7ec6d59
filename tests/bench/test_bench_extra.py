"""The bench extra: ``pagoda serve`` and every bench command's parser work without its packages,
and a benchmark run that needs one stops with the command that installs it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.bench.extras import INSTALL, LazyModule, MissingBenchExtra, bench_import

EXTRA = ("aiohttp", "httpx", "matplotlib")

# Runs with the extra's packages made unimportable (None in sys.modules).
WITHOUT_EXTRA = f"""
import sys
for name in {EXTRA!r}:
    sys.modules[name] = None
import pagoda.entrypoints.openai.server  # pagoda serve's own modules
from pagoda.entrypoints.cli import build_parser, main
parser = build_parser()
for argv in (["bench", "serve"], ["bench", "stress", "streams"], ["bench", "peers", "--model", "m"],
             ["bench", "batch"], ["bench", "priority"],
             ["bench", "sweep"], ["bench", "router"], ["bench", "frontend"]):
    func = parser.parse_args(argv).func
    assert func.__name__ != "fail", f"pagoda bench {{argv[1]}} failed to load without the bench extra"
sys.exit(main(["bench", "stress", "streams", "--base-url", "http://127.0.0.1:9"]))
"""


def test_commands_load_without_the_extra_and_a_run_names_the_install_command():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EXTRA], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert INSTALL in proc.stderr and "'httpx'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_lazy_module_imports_on_first_use(monkeypatch):
    json_module = LazyModule("json")
    assert json_module._module is None  # nothing imported yet
    assert json_module.dumps([1]) == "[1]"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed (other tests may have imported it)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    missing = LazyModule("matplotlib")
    with pytest.raises(MissingBenchExtra, match=r"'matplotlib' package, from pagoda's bench extra: pip install -e"):
        missing.figure
    with pytest.raises(ImportError):  # MissingBenchExtra is an ImportError: old handlers still catch it
        bench_import("matplotlib.pyplot")
