"""``pagoda bench host``: the engine's host work per decode step, with the model taken out.

    pagoda bench host [--batches 1,32,256] [--steps 64] [--profile] [--output-json OUT]

On a GPU a decode step of a small model is shorter than the host's work for it (scheduling,
building the inputs, sampling's bookkeeping, appending tokens, stop checks, outputs), so that
work sets the throughput. This command measures it on any machine: a tiny random Qwen3 (or
``--model``) on the CPU, one decode step per schedule and no async scheduling, the forward pass
replaced by zero logits (so every greedy token is 0 and nothing is computed), and the decode
steps of ``--batches`` requests timed, first with the heap as an offline process has it, then
frozen as the server's engine-core process freezes it (``engine/gc_freeze.py``). Each step is
``LLMEngine.step(finished_only=True)``, as ``LLM.generate`` runs it: the front end folds every
request's new tokens into its state but builds a ``RequestOutput`` only for those that finished
(until 2026-11-29 the bench asked for every request's cumulative output every step, a copy of
each one's tokens so far that neither ``LLM.generate`` nor the server makes: figures from before
that are ~2.5-3 us a sequence step higher, see docs/benchmarks.md). It prints, per
batch and heap, microseconds a step and a sequence step and the full garbage collections among
the steps; with ``--profile`` also the functions the time of the largest batch goes to (cProfile,
which inflates pure-Python code several times: read its shares, not its microseconds).
"""
from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy
import torch

from pagoda.bench.common import print_table, step_stats, write_json
from pagoda.engine import gc_freeze


def stub_forward(llm: Any) -> None:
    """Replace the engine's forward pass with zero logits of the rows it would sample from.

    The zeros come from numpy (``calloc``, one thread), not ``torch.zeros``: from 32768
    elements torch fills in parallel, and with another job on a 2-core machine its OpenMP
    worker waits for a core, so the stub alone took 5-8 ms of a batch-128 step (more than the
    engine's own work, and as noisy as the other job)."""
    runner = llm.engine.core.executor
    vocab = runner.config.model.vocab_size

    def zero_logits(inputs: Any) -> torch.Tensor:
        rows = inputs.input_ids.shape[0] if inputs.logits_all_rows else inputs.logits_indices.shape[0]
        return torch.from_numpy(numpy.zeros((rows, vocab), dtype=numpy.float32))

    runner.step_logits = zero_logits


class FullCollections:
    """Full (oldest-generation) garbage collections while ``on``: how many and their seconds."""

    def __init__(self) -> None:
        self.on = False
        self.pauses: list[float] = []
        self._began = 0.0

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._watch)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._watch)

    def _watch(self, phase: str, info: dict) -> None:
        if info["generation"] != 2 or not self.on:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._began)


def time_steps(llm: Any, batch: int, prompt_len: int, steps: int, seed: int) -> dict[str, Any]:
    """Decode-step wall times of ``batch`` requests of ``steps`` tokens (from the step after
    every request has its first token), the full collections among them, and the tokens the
    requests produced (from their final outputs, to check the stub ran)."""
    from pagoda import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, detokenize=False)
    ids = [f"host-{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1, 100) for _ in range(prompt_len)]}, params)
    # The front end's states, read (outside the timed steps) until every request has a token.
    states = [engine.output_processor.requests[rid] for rid in ids]
    seconds: list[float] = []
    tokens: dict[str, list[int]] = {}
    with FullCollections() as collections:
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            outs = engine.step(finished_only=True)
            took = time.perf_counter() - began
            for out in outs:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            if collections.on:
                seconds.append(took)
            else:
                collections.on = all(s.samples[0].token_ids for s in states)
    stats = step_stats(seconds) or {"median_ms": 0.0, "mean_ms": 0.0}
    return {"batch": batch, "steps": len(seconds), "median_step_us": 1000 * stats["median_ms"],
            "mean_step_us": 1000 * stats["mean_ms"], "us_per_sequence_step": 1000 * stats["median_ms"] / batch,
            "full_collections": len(collections.pauses),
            "full_collection_ms": 1000 * sum(collections.pauses),
            "tokens": sorted({t for ts in tokens.values() for t in ts})}


def make_engine(model: str | None, max_batch: int, prompt_len: int, steps: int) -> tuple[Any, Any]:
    """The engine for the measurement (and the temporary folder of its model, if it made one)."""
    from pagoda import LLM
    from pagoda.tools.make_model import make_model

    folder = None
    if model is None:
        folder = tempfile.TemporaryDirectory(prefix="pagoda-bench-host-")
        model = str(make_model(Path(folder.name) / "m", arch="qwen3", hidden_size=64, num_layers=1, num_heads=4,
                               num_kv_heads=2, head_dim=16, vocab_size=512))
    llm = LLM(model=model, device="cpu", max_model_len=prompt_len + steps + 8, max_num_seqs=max_batch,
              max_num_batched_tokens=max(max_batch * prompt_len, 2048), kv_cache_memory=256 << 20,
              num_scheduler_steps=1, enable_prefix_caching=False)
    stub_forward(llm)
    return llm, folder


def measure(batches: list[int], steps: int, prompt_len: int = 16, model: str | None = None, seed: int = 0,
            profile: bool = False) -> dict[str, Any]:
    """Each batch's decode steps with the heap as an offline process has it (``collected``), then
    frozen as the server's engine-core process freezes it after start-up (``frozen``,
    ``engine/gc_freeze.py``; thawed again before returning, unless the caller had frozen
    objects already: Python thaws all or nothing, so the caller's freeze stands)."""
    llm, folder = make_engine(model, max(batches), prompt_len, steps)
    try:
        time_steps(llm, min(batches), prompt_len, min(steps, 8), seed)  # warm-up
        out: dict[str, Any] = {"steps": steps, "prompt_len": prompt_len,
                               "collected": [time_steps(llm, b, prompt_len, steps, seed + b) for b in batches]}
        with gc_freeze.frozen():
            out["frozen"] = [time_steps(llm, b, prompt_len, steps, seed + b) for b in batches]
            if profile:
                out["profile"] = _profile(llm, max(batches), prompt_len, steps, seed)
    finally:
        llm.shutdown()
        if folder is not None:
            folder.cleanup()
    return out


def _profile(llm: Any, batch: int, prompt_len: int, steps: int, seed: int, top: int = 15) -> list[dict[str, Any]]:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    time_steps(llm, batch, prompt_len, steps, seed)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(key[0]).name}:{key[1]} {key[2]}", "calls": value[0], "share": value[2] / total}
            for key, value in rows]


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    result = measure(batches, args.steps, args.prompt_len, args.model, args.seed, args.profile)
    rows = [("batch", "heap", "median us a step", "us a sequence step", "mean us a step", "full collections")]
    for heap in ("collected", "frozen"):
        rows += [(str(r["batch"]), heap, f"{r['median_step_us']:.0f}", f"{r['us_per_sequence_step']:.1f}",
                  f"{r['mean_step_us']:.0f}", f"{r['full_collections']} ({r['full_collection_ms']:.0f} ms)")
                 for r in result[heap]]
    print_table(f"engine host work per decode step (forward stubbed, CPU), {args.steps} steps", rows)
    for row in result.get("profile", []):
        print(f"  {100 * row['share']:5.1f}%  {row['calls']:7d}  {row['function']}")
    write_json(args.output_json, result)
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("host", help="the engine's host work per decode step, forward stubbed")
    p.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per batch")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--model", default=None, help="a checkpoint (default: a tiny random Qwen3)")
    p.add_argument("--profile", action="store_true", help="cProfile the largest batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
