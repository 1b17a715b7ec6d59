"""``pagoda bench router``'s workload and cache sizing (the run itself needs Ray and minutes; its
parts are checked here)."""
from __future__ import annotations

from pathlib import Path

from pagoda.bench.router import add_cli, kv_cache_bytes, workload


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    return parser.parse_args(["router", *argv])


def test_workload_interleaves_tenants_with_shared_prefixes() -> None:
    args = parse("--num-tenants", "4", "--prefix-len", "40", "--questions", "3", "--question-len", "5")
    prompts = workload(args, vocab=512)
    assert len(prompts) == 12 and all(len(p) == 45 for p in prompts)
    prefixes = [tuple(p[:40]) for p in prompts]
    assert len(set(prefixes)) == 4
    for r in range(3):  # every round, each tenant once
        assert len(set(prefixes[4 * r:4 * r + 4])) == 4
    assert len({tuple(p[40:]) for p in prompts}) == 12  # questions differ
    assert workload(args, vocab=512) == prompts  # seeded
    assert workload(args, vocab=512, seed=1)[0][:40] != prompts[0][:40]


def test_kv_cache_bytes_counts_every_layer_k_and_v(llama_dir: Path) -> None:
    # conftest's llama: 2 layers, 2 KV heads of 16 dims, float32
    assert kv_cache_bytes(str(llama_dir), 100) == 100 * 2 * 2 * 2 * 16 * 4
