"""Per-stage figures of a pipeline-parallel engine for ``pagoda bench latency/throughput``:
each stage's mean step time, the time it waited for its input (the previous stage's hidden
states) and their ratio, the bubble fraction."""
from __future__ import annotations

from typing import Any

from pagoda.bench.common import print_table


def stage_rows(llm: Any, reset: bool = False) -> list[dict[str, float]] | None:
    """The stages' figures since the last reset (None without pipeline parallelism)."""
    executor = llm.engine.core.executor
    if llm.config.parallel.pipeline_parallel_size == 1 or not hasattr(executor, "stage_stats"):
        return None
    return [{"stage": s.stage, "steps": s.steps, "micro_batches_per_step": s.micro_batches / max(s.steps, 1),
             "step_ms": s.step_ms, "wait_ms": s.wait_ms, "bubble": s.bubble} for s in executor.stage_stats(reset)]


def print_stages(rows: list[dict[str, float]] | None, title: str) -> None:
    if not rows:
        return
    table = [("stage", "steps", "micro-batches/step", "step ms", "input wait ms", "bubble")]
    for r in rows:
        table.append((str(r["stage"]), str(r["steps"]), f"{r['micro_batches_per_step']:.2f}", f"{r['step_ms']:.2f}",
                      f"{r['wait_ms']:.2f}", f"{r['bubble']:.3f}"))
    print_table(title, table)
    mean = sum(r["bubble"] for r in rows) / len(rows)
    print(f"pipeline bubble fraction: mean over stages {mean:.3f}, last stage {rows[-1]['bubble']:.3f}")
