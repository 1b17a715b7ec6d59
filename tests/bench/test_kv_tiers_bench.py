"""``pagoda bench kv-tiers`` on a small model: returning prefixes are loaded from the host tier
(cached in every returning request), outputs equal the device-hit run, ratios reported."""
from __future__ import annotations

import argparse
import json

from pagoda.bench import kv_tiers


def test_kv_tiers_command(llama_dir, tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    kv_tiers.add_cli(sub)
    out = tmp_path / "tiers.json"
    args = parser.parse_args(["kv-tiers", "--model", str(llama_dir), "--conversations", "3", "--rounds", "2",
                              "--prefix-len", "64", "--question-len", "8", "--output-len", "2",
                              "--max-model-len", "128", "--device-blocks", "8", "--no-with-disk",
                              "--output-json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "cpu tier / recompute" in text
    report = json.loads(out.read_text())
    assert report["identical"] is True
    res = report["results"]
    assert set(res) == {"off", "cpu", "device"}
    # Device blocks for two conversations' prefixes: a returning one was (mostly) evicted.
    assert res["off"]["cached_fraction_returning"] < res["cpu"]["cached_fraction_returning"] == 64 / 72
    assert res["cpu"]["kv_offload"]["cpu/hit"] > 0
    assert report["ttft_ratio_vs_recompute"]["cpu"] > 0
