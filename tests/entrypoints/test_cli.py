"""The ``pagoda`` command line: what building its parser costs each command."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.entrypoints.cli import BENCH_COMMANDS, build_parser

_PROBE = r"""
import sys
from pagoda.entrypoints.cli import build_parser
argv = sys.argv[1:]
args = build_parser(argv).parse_args(argv)
loaded = sorted(m for m in ("torch", "triton") if m in sys.modules)
benches = sorted(m for m in sys.modules if m.startswith("pagoda.bench."))
print(args.command, loaded, len(benches))
"""


def _probe(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_serve_builds_its_parser_without_the_benchmarks_or_torch() -> None:
    """``pagoda serve``'s command line is parsed without importing a benchmark module, torch or
    triton (the HTTP process imports torch later only to resolve the config; seconds a start)."""
    assert _probe("serve", "--port", "8001") == "serve [] 0"


def test_bench_builds_every_benchmark() -> None:
    """``pagoda bench NAME`` loads the benchmark modules (and ``--help`` without a command lists
    ``bench``); the whole parser still has every benchmark as a subcommand."""
    proc = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in BENCH_COMMANDS:
        assert name in proc.stdout, name
    top = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert top.returncode == 0 and "bench" in top.stdout
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["bench", "no-such-bench"])
    assert exit_info.value.code == 2
    assert parser.parse_args(["bench", "fuzz", "--base-url", "http://127.0.0.1:1"]).bench_command == "fuzz"
