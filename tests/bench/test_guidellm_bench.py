"""``pagoda bench guidellm`` without guidellm: a stand-in executable checks the command line it
is given (guidellm 0.8's) and writes a report shaped like guidellm's, so the command's counting
and exit status are tested here; the real run is the bench command itself (README)."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from pagoda.entrypoints.cli import build_parser

# Writes {"benchmarks": [{"scheduler_metrics": {"requests_made": ...}}]} to the --output path,
# after checking that streaming against the target and the tokenizer were asked for.
FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
assert args[0] == "run", args
opts = dict(zip(args[1::2], args[2::2]))
assert opts["--backend"] == "kind=openai_http,target=http://127.0.0.1:9", opts
assert opts["--tokenizer"] == "kind=hf_auto,model=/tok", opts
assert opts["--constraint"] == "kind=max_requests,count=7", opts
path = opts["--output"].split("path=", 1)[1]
made = {{"successful": 7 - {errored}, "errored": {errored}, "incomplete": 0, "total": 7}}
json.dump({{"benchmarks": [{{"scheduler_metrics": {{"requests_made": made}}}}]}}, open(path, "w"))
"""


def fake_guidellm(tmp_path: Path, errored: int) -> Path:
    path = tmp_path / f"guidellm-{errored}"
    path.write_text(FAKE.format(python=sys.executable, errored=errored))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.parametrize("errored,code", [(0, 0), (2, 1)])
def test_guidellm_bench_counts_and_fails_on_errors(tmp_path: Path, errored: int, code: int) -> None:
    out = tmp_path / "counts.json"
    args = build_parser().parse_args(["bench", "guidellm", "--base-url", "http://127.0.0.1:9/v1", "--guidellm",
                                      str(fake_guidellm(tmp_path, errored)), "--tokenizer", "/tok",
                                      "--requests", "7", "--out", str(out)])
    assert args.func(args) == code
    counts = json.loads(out.read_text())["counts"]
    assert counts == {"successful": 7 - errored, "errored": errored, "incomplete": 0, "total": 7}


def test_guidellm_bench_fails_when_guidellm_fails(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "guidellm", "--guidellm", str(tmp_path / "missing"),
                                      "--tokenizer", "/tok"])
    assert args.func(args) == 1
