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


def test_bench_prefix_multi_turn_is_the_kv_tiers_run(monkeypatch) -> None:
    """``pagoda bench prefix --multi-turn`` (the issue's name for it) runs the kv-tiers command
    with its groups as conversations and its questions per group as rounds."""
    from pagoda.bench import prefix

    seen = {}
    monkeypatch.setattr(kv_tiers, "run", lambda ns: seen.update(vars(ns)) or 0)
    parser = argparse.ArgumentParser()
    prefix.add_cli(parser.add_subparsers())
    args = parser.parse_args(["prefix", "--multi-turn", "--num-groups", "5", "--per-group", "3",
                              "--device-blocks", "38", "--no-with-disk"])
    assert args.func(args) == 0
    assert (seen["conversations"], seen["rounds"], seen["device_blocks"], seen["with_disk"]) == (5, 3, 38, False)
    assert seen["prefix_len"] == 0  # fill the context, as kv-tiers does


def test_kv_restart_command(llama_dir, tmp_path, capsys) -> None:
    """``pagoda bench kv-restart`` at a small size: the restarted engine's first request finds
    the known prefix's full blocks on disk (and in Redis where a redis-server is installed)."""
    import importlib.util
    import shutil

    from pagoda.bench import kv_restart

    parser = argparse.ArgumentParser()
    kv_restart.add_cli(parser.add_subparsers())
    out = tmp_path / "restart.json"
    args = parser.parse_args(["kv-restart", "--model", str(llama_dir), "--prefix-len", "96", "--question-len", "8",
                              "--output-len", "2", "--max-model-len", "128", "--output-json", str(out)])
    assert args.func(args) == 0
    assert "cached after restart" in capsys.readouterr().out
    res = json.loads(out.read_text())["results"]
    redis = shutil.which("redis-server") and importlib.util.find_spec("redis") is not None
    want = {"disk", "redis"} if redis else {"disk"}
    assert set(res) == want
    for r in res.values():
        assert r["identical"] and r["cached_tokens"] == 96 and r["prompt_tokens"] == 104
