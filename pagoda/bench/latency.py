"""``pagoda bench latency``: one request end to end, beside a bare model forward of the same
shapes, so the engine's own overhead per token is visible."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pagoda.bench.common import add_engine_args, engine_kwargs, print_table, random_workload, write_json
from pagoda.bench.stages import print_stages, stage_rows
from pagoda.kvcache.block_table import BlockTable
from pagoda.request import Request, Sequence
from pagoda.sampling_params import SamplingParams
from pagoda.step import ScheduledSeq, SchedulerOutput


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_request(llm: Any, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(time to first token, mean seconds per later token) of one request, via the engine."""
    engine = llm.engine
    engine.add_request("latency", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
    _sync()
    end = time.perf_counter()
    return first - start, (end - first) / max(output_len - 1, 1)


def time_bare_forward(llm: Any, context_len: int, repeats: int) -> float:
    """Seconds for model forward + LM head of one decode token at ``context_len``: no scheduler,
    no sampler, no detokenizer."""
    runner = llm.engine.core.executor
    bs = llm.config.cache.block_size
    req = Request("bare", [1] * context_len, SamplingParams(max_tokens=1), ())
    seq = Sequence("bare#0", req, [1] * (context_len + 1))
    seq.block_table = BlockTable(range(-(-(context_len + 1) // bs)))
    sched = SchedulerOutput([ScheduledSeq(seq, context_len, 1)], 1)
    inputs, _ = runner.prepare(sched)
    times = []
    for _ in range(repeats + 2):
        _sync()
        t = time.perf_counter()
        with torch.inference_mode():
            hidden = runner.forward(inputs)
            runner.model.compute_logits(hidden[inputs.logits_indices])
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM

    llm = LLM(**engine_kwargs(args))
    prompt = random_workload(1, str(args.input_len), "1", llm.config.model.vocab_size, args.seed).prompts[0]
    time_request(llm, prompt, 4)  # warm-up
    stage_rows(llm, reset=True)
    # The bare forward needs the whole model in this process (not split over ranks).
    local = llm.config.parallel.tensor_parallel_size * llm.config.parallel.pipeline_parallel_size == 1
    # Engine runs and bare forwards alternate, so drift in the machine's speed hits both alike.
    runs, bares = [], []
    for _ in range(args.num_iters):
        runs.append(time_request(llm, prompt, args.output_len))
        if local:
            bares.append(time_bare_forward(llm, args.input_len + args.output_len // 2,
                                           repeats=max(10, args.output_len // 4)))
    stages = stage_rows(llm)
    ttft = statistics.median(r[0] for r in runs)
    per_token = statistics.median(r[1] for r in runs)
    bare = statistics.median(bares) if bares else None
    ratio = per_token / bare if bare else None
    print_table(f"latency: input {args.input_len}, output {args.output_len}, batch 1", [
        ("measure", "ms"),
        ("time to first token", f"{ttft * 1e3:.2f}"),
        ("per output token (engine)", f"{per_token * 1e3:.2f}"),
        ("bare forward + LM head", f"{bare * 1e3:.2f}" if bare else "n/a (model split over ranks)"),
    ])
    if ratio is not None:
        print(f"engine per-token time / bare forward: {ratio:.3f}x")
    print_stages(stages, "pipeline stages (per engine step)")
    write_json(args.output_json, {"input_len": args.input_len, "output_len": args.output_len,
                                  "ttft_ms": ttft * 1e3, "ms_per_output_token": per_token * 1e3,
                                  "bare_forward_ms": bare * 1e3 if bare else None, "overhead_ratio": ratio,
                                  "pipeline_stages": stages})
    llm.shutdown()
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("latency", help="batch-1 latency against a bare forward")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run)
