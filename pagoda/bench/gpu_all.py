"""``pagoda bench gpu all``: every GPU measurement in one prepared command, inside a time budget.

    pagoda bench gpu all [--budget-s 420] [--json OUT] [--dry-run] [--stages a,b]

Made for short GPU leases. The stages, most important first (gpu_stages.py):

| stage | measures | share of 420 s |
|---|---|---|
| device | the card, torch and Triton versions, device copy bandwidth | 10 |
| smoke | a tiny checkpoint in bf16 (CUDA graphs on) against transformers, at the bf16 level | 45 |
| attention | ``bench gpu attention``: Triton paged attention against the torch backend | 35 |
| mla-decode | DeepSeek-V3's latent decode (128 heads, 32 x 2047): the MLA kernel's tiles against float32 and the generic kernel | 25 |
| roofline-qwen3-0.6b-bf16, roofline-llama3-8b-bf16 | batch-1 decode against the memory roofline | 45, 60 |
| qkv-prepare | a layer's q/k norms, rotary and KV write as four launches and as one (``gpu_layers.py``), every layer of the 0.6B and 8B shapes in a CUDA graph at 1 and 32 rows | 10 |
| skinny-gemm | the few-rows GEMM's configs against cuBLAS on the 0.6B and 8B projections at 1, 4 and 16 rows, and what the engine's choice keeps | 15 |
| decode-splits | batch-1 decode attention (8B heads, 32 layers' worth in a CUDA graph) at contexts 384 and 2,048 with 1, 4 and 16 splits (a graph pins 16 at 4,096 positions) | 8 |
| sync-watch | greedy decode (batch 4, 32 tokens) of the Qwen3-0.6B shape with async scheduling under torch's CUDA sync debug mode: synchronizing calls a step and the lines making them | 10 |
| decode-kernels | batch-1 decode of the Qwen3-0.6B shape under the profiler: device time per kernel, host gap | 25 |
| host-profile | the same steps without async scheduling under cProfile: the functions the host time goes to; then at batch 32 | 10 |
| pdl | batch-1 decode of the Qwen3-0.6B shape with the decode path's Triton kernels launched without and with programmatic dependent launch (``PAGODA_PDL``): tok/s, roofline fraction, same greedy tokens | 30 |
| decode-kernels-llama3-8b | batch-1 decode of the Llama-3-8B shape under the profiler (async scheduling): device time per kernel, idle time, and the device time against the weights' read at the copy rate | 20 |
| device-rounds | batch-1 decode without async scheduling: the Qwen3-0.6B shape one step per schedule and in the automatic multi-step greedy rounds through the decode graphs (each step's argmax fed to the next on the device), same greedy tokens; then the rounds on the Llama-3-8B shape | 45 |
| roofline-llama3-8b-fp8 | the same in fp8, where the card has fp8 and pagoda multiplies in it | 60 |
| fp8-w8a8-llama3-8b-batch32 | batch-32 decode of the Llama-3-8B shape, fp8 W8A8 against bf16, and their greedy tokens' agreement | 80 |
| fp8-gemms | the Llama-3-8B projections at 32 rows: bf16, per-channel W8A8 and block-scaled W8A8 (blocks of 128), ms and error | 20 |
| fp8-kernels | batch-32 decode steps of the Llama-3-8B shape under the profiler, bf16 then fp8 (async scheduling): device time per kernel | 20 |
| moe-graphs | a small random Qwen3-MoE checkpoint decoded at batch 8 eagerly and in CUDA graphs: captured, same greedy tokens, tok/s | 25 |
| lora-graphs | a small random Llama with three adapters, batch 8 of adapter and base rows, eagerly and in CUDA graphs: captured, same greedy tokens, tok/s | 25 |
| async-scheduling | batch-1 and batch-32 decode of the Qwen3-0.6B shape with ``--async-scheduling`` off and on | 40 |
| throughput | the nano-vllm workload (256 sequences) with async scheduling, its steps profiled (``step_profile.py``), and pagoda on its heads of 64, 128, 192; then the whole workload synchronously when time allows | 75 |
| throughput-hf | transformers ``generate`` on as many whole batches of 64 as the time left allows, and the ratio | 80 |

No weights are written for the real shapes (random weights made on the device). The budget
clock starts with the command. Each stage is allotted its share (the shares above scaled to the
budget), or more where the stages before it left time unused beyond what the later stages'
shares need; the last takes all that is left. ``RESERVE_S`` stays for the report. A stage whose
allotment is under its minimum is skipped, with the reason; one still running when its
allotment ends is stopped (an exception raised in the main thread at its next Python
instruction) and keeps what it measured; one that raises is reported with its error, and the
next stage runs. A watchdog writes the report and ends the process at the budget should a stage
hang inside one native call.

After each stage its engines are collected; should more than ``gpu_leaks.LEAK_BYTES`` stay
allocated, the record's ``left_on_device`` names the largest tensors and what holds them.
``--stages`` runs a subset (one process a stage keeps one stage's leak from starving the next).

Each stage's line is printed as it ends and the JSON (``--json``) is rewritten before the first
stage and after every stage, so a lease cut short still leaves what was measured.

``--dry-run`` walks through the same stages, accounting, table and JSON on CPU with tiny shapes
(``gpu_stages.DRY_PLAN``) in well under a minute; CI runs it.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pagoda.bench import gpu, gpu_fp8, gpu_gemm, gpu_kernels, gpu_layers, gpu_leaks, gpu_sync
from pagoda.bench import gpu_decode_gaps as gaps
from pagoda.bench import gpu_stages as st
from pagoda.bench.common import machine, print_table
from pagoda.engine import gc_freeze

NOMINAL_BUDGET_S = 420.0
RESERVE_S = 10.0  # kept back for the report and the teardown of the last stage
DRY_MIN_FACTOR = 0.05  # the dry run's tiny shapes need a small part of a GPU stage's minimum


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[st.Ctx, st.Out], None]
    summary: Callable[[st.Out], str]
    share_s: float  # of NOMINAL_BUDGET_S
    min_s: float  # the least time in which it measures anything on a GPU


STAGES: tuple[Stage, ...] = (
    Stage("device", st.stage_device, st.summary_device, 10, 2),
    Stage("smoke", st.stage_smoke, st.summary_smoke, 45, 15),
    Stage("attention", st.stage_attention, st.summary_attention, 35, 10),
    Stage("mla-decode", st.stage_mla_decode, st.summary_mla_decode, 25, 20),
    Stage("roofline-qwen3-0.6b-bf16", st.roofline_stage("qwen3-0.6b", None), st.summary_roofline, 45, 20),
    Stage("roofline-llama3-8b-bf16", st.roofline_stage("llama3-8b", None), st.summary_roofline, 60, 30),
    Stage("qkv-prepare", st.stage_qkv_prepare, gpu_layers.summary, 10, 8),
    Stage("skinny-gemm", st.stage_skinny_gemm, gpu_layers.summary_skinny, 15, 10),
    Stage("decode-splits", st.stage_decode_splits, gpu_layers.summary_splits, 8, 8),
    Stage("sync-watch", st.stage_sync_watch, gpu_sync.summary, 10, 10),
    Stage("decode-kernels", st.stage_decode_kernels, gpu_kernels.summary, 25, 15),
    Stage("host-profile", st.stage_host_profile, gpu_kernels.summary_host, 10, 8),
    Stage("pdl", gaps.stage_pdl, gaps.summary_pdl, 30, 20),
    Stage("decode-kernels-llama3-8b", gaps.stage_decode_kernels_8b, gaps.summary_decode_kernels_8b, 20, 15),
    Stage("device-rounds", gaps.stage_device_rounds, gaps.summary_device_rounds, 45, 25),
    Stage("roofline-llama3-8b-fp8", st.roofline_stage("llama3-8b", "fp8"), st.summary_roofline, 60, 30),
    Stage("fp8-w8a8-llama3-8b-batch32", gpu_fp8.stage_fp8_w8a8, gpu_fp8.summary_fp8_w8a8, 80, 40),
    Stage("fp8-gemms", st.stage_fp8_gemms, gpu_gemm.summary, 20, 15),
    Stage("fp8-kernels", gpu_fp8.stage_fp8_kernels, gpu_fp8.summary_fp8_kernels, 20, 15),
    Stage("moe-graphs", st.stage_moe_graphs, st.summary_moe_graphs, 25, 20),
    Stage("lora-graphs", st.stage_lora_graphs, st.summary_lora_graphs, 25, 20),
    Stage("async-scheduling", st.stage_async_scheduling, st.summary_async_scheduling, 40, 20),
    Stage("throughput", st.stage_throughput, st.summary_throughput, 75, 30),
    Stage("throughput-hf", st.stage_throughput_hf, st.summary_throughput_hf, 80, 30),
)


def select_stages(names: str | None, stages: tuple[Stage, ...] = STAGES) -> tuple[Stage, ...]:
    """The stages named in the comma-separated ``names`` (None: all), in their usual order, with
    ``device`` always first (the others read its copy bandwidth). ``ValueError`` names unknown ones."""
    if not names:
        return stages
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {s.name for s in stages}
    if unknown:
        raise ValueError(f"unknown stages {', '.join(sorted(unknown))}; the stages are "
                         f"{', '.join(s.name for s in stages)}")
    return tuple(s for s in stages if s.name in wanted or s.name == "device")


def reserve_s(budget_s: float) -> float:
    return min(RESERVE_S, 0.05 * budget_s)


def allotment(stages: tuple[Stage, ...], i: int, left_s: float, budget_s: float) -> float:
    """Seconds stage ``i`` may run with ``left_s`` of the budget left: its scaled share, or all
    that the later stages' scaled shares do not need if that is more, never past the reserve."""
    usable = left_s - reserve_s(budget_s)
    scale = (budget_s - reserve_s(budget_s)) / sum(s.share_s for s in stages)
    later = scale * sum(s.share_s for s in stages[i + 1:])
    return min(usable, max(scale * stages[i].share_s, usable - later))


# --------------------------------------------------------------------------------------
# stopping a stage
# --------------------------------------------------------------------------------------


class StageTimeout(BaseException):
    """Raised in the main thread when the stage in progress passes its allotment (a
    ``BaseException``, so that no ``except Exception`` inside a stage swallows it)."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread at its next Python instruction (None: drop a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


class Alarm:
    """Raises ``StageTimeout`` in the thread that made it after ``seconds``, unless disarmed
    first; ``disarm`` also drops one that fired but has not been delivered yet."""

    def __init__(self, seconds: float) -> None:
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._armed, self.fired = True, False
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._armed:
                self.fired = True
                _raise_in(self._thread_id, StageTimeout)

    def disarm(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._armed = False
            if self.fired:
                _raise_in(self._thread_id, None)


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------


class Report:
    """Every stage's record (status, seconds, allotment, reason or error, figures), printed and
    written as JSON; the lock keeps the watchdog and the main thread from writing at once."""

    def __init__(self, stages: tuple[Stage, ...], budget_s: float, dry_run: bool, path: str | None) -> None:
        self.stages, self.path, self.lock = stages, path, threading.RLock()
        self.payload: dict[str, Any] = {
            "command": "pagoda bench gpu all", "budget_s": budget_s, "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "finished": False, "elapsed_s": 0.0,
            "machine": machine(), "stages": [{"name": s.name, "status": "pending"} for s in stages]}

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.payload["stages"]

    def flush(self, elapsed_s: float) -> None:
        """Rewrite the JSON whole (written aside, then renamed: a reader never sees half of it)."""
        with self.lock:
            self.payload["elapsed_s"] = round(elapsed_s, 1)
            if not self.path:
                return
            tmp = Path(f"{self.path}.tmp")
            tmp.write_text(json.dumps(self.payload, indent=2, default=str) + "\n")
            os.replace(tmp, self.path)

    def line(self, i: int) -> str:
        record = self.records[i]
        text = self.stages[i].summary(record.get("result") or {})
        note = record.get("reason") or record.get("error") or ""
        return "; ".join(x for x in (text, note) if x)

    def print_table(self) -> None:
        rows = [("stage", "status", "seconds", "figures")]
        for i, record in enumerate(self.records):
            spent = f"{record['seconds']:.0f} / {record['allotted_s']:.0f}" if "seconds" in record else \
                (f"- / {record['allotted_s']:.0f}" if "allotted_s" in record else "-")
            rows.append((record["name"], record["status"], spent, self.line(i)))
        kind = "dry run on CPU" if self.payload["dry_run"] else self.payload["machine"].get("gpu", "no GPU")
        print_table(f"pagoda bench gpu all: {kind}, {self.payload['elapsed_s']:.0f} s of a "
                    f"{self.payload['budget_s']:.0f} s budget (seconds: used / allotted)", rows)
        if self.path:
            print(f"wrote {self.path}")
        sys.stdout.flush()


class Watchdog:
    """At the end of the budget, if the run has not finished: the stage in progress is recorded
    as stopped, the report written and printed, and the process ended (exit status 3)."""

    def __init__(self, report: Report, start: float, budget_s: float,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.report, self.start, self.budget_s, self.exit = report, start, budget_s, exit
        self._timer = threading.Timer(budget_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self.report.lock:
            for record in self.report.records:
                if record["status"] == "running":
                    record.update(status="stopped", reason=f"still running at the end of the {self.budget_s:.0f} s "
                                                           "budget, inside one native call: the process was ended")
            self.report.flush(time.monotonic() - self.start)
            self.report.print_table()
            self.exit(3)

    def cancel(self) -> None:
        self._timer.cancel()


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------


def run_stage(stage: Stage, ctx: st.Ctx, record: dict[str, Any], allotted_s: float) -> None:
    """Run one stage inside its allotment; its status, reason or error land in ``record``."""
    out: st.Out = ctx.results.setdefault(stage.name, {})
    record["result"] = out
    try:
        alarm = Alarm(allotted_s)
        try:
            stage.run(ctx, out)
        finally:
            alarm.disarm()
        record["status"] = "ok"
    except StageTimeout:
        record.update(status="stopped", reason=f"still running at the end of its {allotted_s:.0f} s allotment")
    except st.NotAvailable as exc:
        record.update(status="not available", reason=str(exc))
    except st.Skipped as exc:
        record.update(status="skipped", reason=str(exc))
    except Exception as exc:  # one stage's failure must not cost the others their measurement
        traceback.print_exc()
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}")


def run_stages(report: Report, plan: st.Plan, start: float, budget_s: float) -> None:
    results: dict[str, st.Out] = {}
    for i, stage in enumerate(report.stages):
        record = report.records[i]
        allotted = allotment(report.stages, i, budget_s - (time.monotonic() - start), budget_s)
        least = stage.min_s * (DRY_MIN_FACTOR if plan.dry_run else 1.0)
        record["allotted_s"] = round(max(allotted, 0.0), 1)
        if allotted < least:
            record.update(status="skipped", reason=f"needs at least {least:.0f} s; "
                                                   f"{max(allotted, 0.0):.0f} s of the budget left for it")
        else:
            with report.lock:
                record["status"] = "running"
                report.flush(time.monotonic() - start)
            began = time.monotonic()
            try:
                run_stage(stage, st.Ctx(plan, results, began + allotted), record, allotted)
            finally:
                record["seconds"] = round(time.monotonic() - began, 1)
                gpu.free_device_memory()
                leak = gpu_leaks.left_on_device()
                if leak is not None:  # the next stage's memory profile would count it as its own
                    record["left_on_device"] = leak
        with report.lock:
            print(f"[gpu all] {stage.name}: {record['status']}"
                  + (f" in {record['seconds']:.1f} s" if "seconds" in record else "")
                  + f" (allotted {record['allotted_s']:.0f} s): {report.line(i)}", flush=True)
            report.flush(time.monotonic() - start)


@contextlib.contextmanager
def dry_run_device() -> Iterator[None]:
    """The engines on the CPU for the dry run (restored after); Triton's interpreter on where
    there is no GPU and Triton is not yet imported (the attention stage's kernels)."""
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    saved = gpu.DEVICE
    gpu.DEVICE = "cpu"
    try:
        yield
    finally:
        gpu.DEVICE = saved


def run_all(args: argparse.Namespace, stages: tuple[Stage, ...] | None = None,
            exit: Callable[[int], Any] = os._exit) -> int:
    """Exit status: 0 when no stage failed (skipped, stopped and not-available stages are
    reported, not failures), 1 when one did; the watchdog ends the process with ``exit(3)``."""
    if args.budget_s <= 0:
        print(f"--budget-s must be positive, got {args.budget_s}", file=sys.stderr)
        return 2
    try:
        stages = select_stages(getattr(args, "stages", None), STAGES if stages is None else stages)
    except ValueError as exc:
        print(f"--stages: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    report = Report(stages, args.budget_s, args.dry_run, args.output_json)
    report.flush(0.0)
    watchdog = Watchdog(report, start, args.budget_s, exit)
    try:
        # Every engine's shutdown and every stage's end collect cycles (``gpu.free_device_memory``);
        # the imported modules' objects are left out of those sweeps (a third of a second each
        # over torch's and transformers' objects).
        with gc_freeze.frozen(collect_first=True), \
                dry_run_device() if args.dry_run else contextlib.nullcontext():
            run_stages(report, st.DRY_PLAN if args.dry_run else st.GPU_PLAN, start, args.budget_s)
    except BaseException:  # Ctrl-C: what was measured is kept
        with report.lock:
            for record in report.records:
                if record["status"] == "running":
                    record.update(status="interrupted")
            report.flush(time.monotonic() - start)
        raise
    finally:
        watchdog.cancel()
    with report.lock:
        report.payload["finished"] = True
        report.flush(time.monotonic() - start)
        report.print_table()
    return 1 if any(r["status"] == "failed" for r in report.records) else 0


def add_parser(sub: argparse._SubParsersAction, guard: Callable) -> None:
    p = sub.add_parser("all", help="every GPU measurement (smoke test, rooflines, throughput against HF, attention) "
                                   "in one command inside a time budget")
    p.add_argument("--budget-s", type=float, default=NOMINAL_BUDGET_S,
                   help="seconds the whole command may take (stages get shares of it)")
    p.add_argument("--json", "--output-json", dest="output_json", default=None,
                   help="JSON report, rewritten after every stage")
    p.add_argument("--dry-run", action="store_true",
                   help="walk through every stage on CPU with tiny shapes (no GPU needed)")
    p.add_argument("--stages", default=None,
                   help="comma-separated stage names to run (device always runs first); default: all")
    needs_cuda = guard(run_all)
    p.set_defaults(func=lambda args: run_all(args) if args.dry_run else needs_cuda(args))
