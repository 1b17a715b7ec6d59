"""Shared pieces of the offline benchmark commands: seeded workloads, engine flags, reports."""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.datasets import parse_range
from pagoda.config import EngineArgs

# Random prompt ids avoid the special tokens at the bottom of the vocabulary.
FIRST_ORDINARY_ID = 16


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_workload(num_prompts: int, input_len: str, output_len: str, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = parse_range(input_len), parse_range(output_len)
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(rng.randint(ilo, ihi))]
               for _ in range(num_prompts)]
    return Workload(prompts, [rng.randint(olo, ohi) for _ in range(num_prompts)])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine flag (generated from ``EngineArgs``), so benchmarks tune what the server tunes."""
    EngineArgs.add_cli_args(parser)


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    ea = EngineArgs.from_namespace(args)
    kwargs = {f: getattr(ea, f) for f in ea.__dataclass_fields__}
    kwargs.update(overrides)
    return kwargs


def machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def seconds_per_call(fn, min_s: float, warmup: int = 1) -> float:
    """Seconds per call of ``fn``: ``warmup`` calls, then calls repeated for at least ``min_s``."""
    for _ in range(warmup):
        fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def step_stats(seconds: list[float], slow_factor: float = 3.0) -> dict[str, Any]:
    """Median, mean and longest step in ms, and the steps over ``slow_factor`` times the median
    (how many, and the ms they took beyond it): whether a rate is uniform or a few stalls."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    median = ordered[len(ordered) // 2]
    slow = [s for s in seconds if s > slow_factor * median]
    return {"count": len(seconds), "median_ms": 1000 * median, "mean_ms": 1000 * sum(seconds) / len(seconds),
            "max_ms": 1000 * ordered[-1], "slow": len(slow), "slow_excess_ms": 1000 * sum(s - median for s in slow)}


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps({**payload, "machine": machine()}, indent=2) + "\n")
        print(f"wrote {path}")


def print_table(title: str, rows: list[tuple[str, ...]]) -> None:
    print(f"\n== {title} ==")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
