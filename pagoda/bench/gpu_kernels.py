"""``pagoda bench gpu kernels``: where a decode step's device time goes, kernel by kernel.

    pagoda bench gpu kernels --shape qwen3-0.6b [--batch 1] [--steps 64] [--enforce-eager]

Decodes ``--steps`` tokens of the shape (random weights made on the device) under
``torch.profiler`` and prints, per kernel, its calls and microseconds per step, and the step's
time split into device time (the sum of kernel times) and the host gap (wall time the device
sits idle: scheduling, input preparation, sampling, synchronisation). The same figures are the
``decode-kernels`` stage of ``pagoda bench gpu all``; on CPU the table holds CPU operators.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Callable

from pagoda.bench import gpu
from pagoda.bench.common import print_table, write_json
from pagoda.bench.gpu_model import SHAPES, bench_shape_dir


def profile_decode(model_dir: Path, batch: int, input_len: int, steps: int, enforce_eager: bool = False,
                   gpu_memory_utilization: float = 0.5, top: int = 15, seed: int = 0,
                   async_scheduling: bool = False, quantization: str | None = None) -> dict[str, Any]:
    """Decode tok/s of ``model_dir`` and the per-step time of its ``top`` kernels (by self
    device time; CPU operators on a CPU run) over ``steps`` profiled decode steps; on a GPU also
    where the device sat idle between kernels (``idle``: ``device_idle``); and the bytes of
    weights a step reads (``weight_bytes_per_step``)."""
    from torch.profiler import ProfilerActivity, profile

    from pagoda import LLM

    llm = LLM(**gpu.engine_kwargs(model_dir, input_len + 2 * steps + 16, enforce_eager, gpu_memory_utilization,
                                  max_num_seqs=batch, async_scheduling=async_scheduling, quantization=quantization))
    try:
        rng = random.Random(seed)
        vocab = gpu._vocab_size(model_dir)
        prompts = [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(batch)]
        gpu.time_decode(llm, prompts, min(steps, 16))  # warm-up: compilation, graphs, allocator
        seconds, tokens = gpu.time_decode(llm, prompts, steps)
        on_cuda = gpu.DEVICE == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            _, profiled_tokens = gpu.time_decode(llm, prompts, steps)
        weight_bytes = gpu.weight_bytes_per_step(llm.engine.core.executor.model)
    finally:
        llm.shutdown()
    step_count = max(1, profiled_tokens // batch)
    attr = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    # Kernels are the events with device time and no CPU time of their own; on CPU, operators.
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0
              and (not on_cuda or getattr(e, "self_cpu_time_total", 0) == 0)]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    device_us = sum(getattr(e, attr) for e in events) / step_count
    step_ms = 1000 * seconds / max(1, tokens // batch)
    kernels = [{"name": e.key, "calls_per_step": e.count / step_count,
                "us_per_step": getattr(e, attr) / step_count} for e in events[:top]]
    return {"batch": batch, "input_len": input_len, "steps": steps, "cuda_graphs": not enforce_eager,
            "async_scheduling": async_scheduling, "quantization": quantization,
            "decode_tokens_per_s": tokens / seconds, "step_ms": step_ms, "device_ms_per_step": device_us / 1000,
            "weight_bytes_per_step": weight_bytes,
            "host_gap_ms_per_step": max(0.0, step_ms - device_us / 1000) if on_cuda else None,
            "kernels": kernels, "idle": device_idle(prof, step_count) if on_cuda else None}


def device_idle(prof: Any, step_count: int, gap_us: float = 5.0) -> dict[str, Any]:
    """Where the device sat idle in a profile: the gaps between one kernel's end and the next
    one's start, per step (all of them, and those of at least ``gap_us``), the longest few, and the
    name of the kernel each of the longest follows."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    gaps = [(nxt[0] - cur[1], cur[2]) for cur, nxt in zip(spans, spans[1:]) if nxt[0] > cur[1]]
    long = sorted((g for g in gaps if g[0] >= gap_us), reverse=True)
    return {"idle_us_per_step": sum(g for g, _ in gaps) / step_count,
            "long_gaps_per_step": len(long) / step_count,
            "long_idle_us_per_step": sum(g for g, _ in long) / step_count,
            "longest": [{"us": g, "after": name[:80]} for g, name in long[:8]]}


def profile_host(model_dir: Path, batch: int, input_len: int, steps: int, gpu_memory_utilization: float = 0.5,
                 top: int = 20, seed: int = 0) -> dict[str, Any]:
    """Where a decode step's host time goes: ``steps`` greedy decode steps, one step a schedule and
    no async scheduling (so every host instruction of the step is on its critical path), under
    cProfile. The step's wall time, and the ``top`` functions by time spent in themselves per
    step (pagoda's as ``path:line name``, torch's and Python's built-ins by name), with calls per step."""
    import cProfile
    import pstats
    import time

    from pagoda import LLM

    llm = LLM(**gpu.engine_kwargs(model_dir, input_len + 2 * steps + 16, False, gpu_memory_utilization,
                                  max_num_seqs=batch, num_scheduler_steps=1, async_scheduling=False))
    try:
        rng = random.Random(seed)
        vocab = gpu._vocab_size(model_dir)
        prompts = [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(batch)]
        gpu.time_decode(llm, prompts, min(steps, 16))  # warm-up
        seconds, tokens = gpu.time_decode(llm, prompts, steps)
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        _, profiled_tokens = gpu.time_decode(llm, prompts, steps)
        profiler.disable()
        profiled_s = time.perf_counter() - started
    finally:
        llm.shutdown()
    step_count = max(1, profiled_tokens // batch)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    package = str(Path(__file__).resolve().parents[1].parent)
    functions = [{"function": _where(key, package), "calls_per_step": value[0] / step_count,
                  "self_us_per_step": 1e6 * value[2] / step_count} for key, value in rows]
    return {"batch": batch, "input_len": input_len, "steps": steps,
            "step_ms": 1000 * seconds / max(1, tokens // batch),
            "profiled_step_ms": 1000 * profiled_s / step_count, "functions": functions}


def _where(key: tuple[str, int, str], package: str) -> str:
    path, line, name = key
    if path.startswith(package):
        return f"{path[len(package) + 1:]}:{line} {name}"
    return name if path == "~" else f"{Path(path).name}:{line} {name}"


def summary_host(out: dict[str, Any]) -> str:
    if "functions" not in out or not out["functions"]:
        return ""
    heaviest = "; ".join(f"{f['function'][:60]} {f['self_us_per_step']:.0f} us" for f in out["functions"][:3])
    text = (f"{out['step_ms']:.3f} ms a step without async scheduling (batch {out['batch']}; "
            f"{out['profiled_step_ms']:.3f} under cProfile); most host time in: {heaviest}")
    more = [summary_host(v) for k, v in out.items() if k.startswith("batch_") and isinstance(v, dict)]
    return " | ".join([text] + more)


def summary(out: dict[str, Any]) -> str:
    """One line: step time, device time, host gap and the heaviest kernel ("" before any figure)."""
    if "step_ms" not in out:
        return ""
    gap = out.get("host_gap_ms_per_step")
    top = out["kernels"][0] if out.get("kernels") else None
    heaviest = f"; heaviest {top['name'][:40]} {top['us_per_step']:.0f} us" if top else ""
    gap_text = f", host gap {gap:.3f} ms" if gap is not None else ""
    idle = out.get("idle")
    idle_text = (f", idle {idle['idle_us_per_step']:.0f} us a step ({idle['long_gaps_per_step']:.1f} gaps of 5+ us)"
                 if idle else "")
    text = (f"{out['step_ms']:.3f} ms a step ({out['decode_tokens_per_s']:,.0f} tok/s): device "
            f"{out['device_ms_per_step']:.3f} ms{gap_text}{idle_text}{heaviest}")
    if isinstance(out.get("async"), dict) and "step_ms" in out["async"]:
        text += f" | async scheduling: {summary(out['async'])}"
    return text


def run_kernels(args: argparse.Namespace) -> int:
    result = profile_decode(bench_shape_dir(args.shape), args.batch, args.input_len, args.steps, args.enforce_eager,
                            args.gpu_memory_utilization, args.top, args.seed)
    rows = [("kernel", "calls / step", "us / step")]
    rows += [(k["name"][:70], f"{k['calls_per_step']:.1f}", f"{k['us_per_step']:.1f}") for k in result["kernels"]]
    print_table(f"decode kernels: {args.shape} bf16, batch {args.batch}, CUDA graphs "
                f"{'off' if args.enforce_eager else 'on'}: {summary(result)}", rows)
    write_json(args.output_json, {"shape": args.shape, **result})
    return 0


def add_parser(sub: argparse._SubParsersAction, guard: Callable) -> None:
    p = sub.add_parser("kernels", help="device time per kernel of a decode step, and the host gap")
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="decode steps profiled")
    p.add_argument("--top", type=int, default=15, help="kernels listed")
    p.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=guard(run_kernels))
