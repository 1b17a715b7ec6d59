"""``pagoda bench frontend`` end to end on a tiny checkpoint: a real server subprocess, the
warm-up and measured rounds, identical outputs on both paths, and the JSON it writes."""
from __future__ import annotations

import json

from pagoda.entrypoints.cli import build_parser


def test_frontend_bench_runs_rounds_and_compares_outputs(llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "fe.json"
    args = build_parser().parse_args([
        "bench", "frontend", "--model", str(llama_dir), "--num-prompts", "4", "--input-len", "8:24",
        "--output-len", "4:8", "--rounds", "2", "--kv-cache-memory", str(16 << 20),
        "--output-json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        assert r["identical_outputs"] == 4  # greedy, ignore_eos: both paths give the same tokens
        assert r["offline"]["output_tokens"] == r["server"]["output_tokens"] > 0
    total = lambda side: (sum(r[side]["output_tokens"] for r in result["rounds"])
                          / sum(r[side]["elapsed_s"] for r in result["rounds"]))
    assert abs(result["ratio"] - total("server") / total("offline")) < 1e-9
    assert "server / offline output tok/s" in capsys.readouterr().out
