"""``pagoda bench chunked``: N streams keep decoding while long prompts arrive at intervals;
inter-token latency of the streams, the long prompts' time to first token and throughput, with
chunked prefill on and off in one run."""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np

from pagoda.bench.common import FIRST_ORDINARY_ID, add_engine_args, engine_kwargs, print_table, write_json


class _Scenario:
    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        rng = random.Random(args.seed)
        draw = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
        self.streams = [draw(args.stream_prompt_len) for _ in range(args.num_streams)]
        self.longs = [draw(args.long_len) for _ in range(args.num_long)]
        self.args = args


def run_scenario(kwargs: dict[str, Any], sc: _Scenario) -> dict[str, float]:
    from pagoda import LLM, SamplingParams

    args = sc.args
    llm = LLM(**kwargs)
    engine = llm.engine
    # Streams outlast the measurement; they are aborted once every long prompt has its first token.
    stream_params = SamplingParams(temperature=0, ignore_eos=True,
                                   max_tokens=llm.config.model.max_model_len - args.stream_prompt_len - 1)
    for i, p in enumerate(sc.streams):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, stream_params)
    last: dict[str, float] = {}
    while len(last) < len(sc.streams):  # every stream is decoding before the clock starts
        for out in engine.step():
            last[out.request_id] = time.perf_counter()
    gaps, ttft, arrivals, tokens = [], {}, {}, 0
    start = time.perf_counter()
    next_arrival = start
    while len(ttft) < len(sc.longs):
        now = time.perf_counter()
        if len(arrivals) < len(sc.longs) and now >= next_arrival:
            rid = f"long{len(arrivals)}"
            engine.add_request(rid, {"prompt_token_ids": sc.longs[len(arrivals)]},
                               SamplingParams(temperature=0, max_tokens=args.long_output_len, ignore_eos=True))
            arrivals[rid] = now
            next_arrival = now + args.interval
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid.startswith("s"):
                gaps.append(t - last[rid])
                last[rid] = t
                tokens += 1
            elif rid not in ttft and out.outputs[0].token_ids:
                ttft[rid] = t - arrivals[rid]
    elapsed = time.perf_counter() - start
    tokens += sum(args.long_len for _ in sc.longs)
    for i in range(len(sc.streams)):
        engine.abort_request(f"s{i}")
    while engine.has_unfinished_requests():
        engine.step()
    llm.shutdown()
    g = np.array(gaps) * 1e3
    return {"itl_p50_ms": float(np.percentile(g, 50)), "itl_p99_ms": float(np.percentile(g, 99)),
            "itl_max_ms": float(g.max()), "long_ttft_mean_s": float(np.mean(list(ttft.values()))),
            "tokens_per_s": tokens / elapsed, "elapsed_s": elapsed}


def run(args: argparse.Namespace) -> int:
    from pagoda.config import EngineArgs, EngineConfig

    base = engine_kwargs(args)
    cfg = EngineConfig.from_args(EngineArgs.from_namespace(args))
    sc = _Scenario(args, cfg.model.vocab_size)
    whole_budget = args.long_len + args.num_streams
    results = {
        "chunked": run_scenario({**base, "enable_chunked_prefill": True}, sc),
        "unchunked": run_scenario({**base, "enable_chunked_prefill": False,
                                   "max_num_batched_tokens": max(whole_budget, cfg.scheduler.max_num_batched_tokens)},
                                  sc),
    }
    rows = [("mode", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "long TTFT s", "tokens/s")]
    for mode, r in results.items():
        rows.append((mode, f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}", f"{r['itl_max_ms']:.1f}",
                     f"{r['long_ttft_mean_s']:.2f}", f"{r['tokens_per_s']:.1f}"))
    print_table(f"chunked prefill: {args.num_streams} streams, {args.num_long} prompts of {args.long_len} tokens "
                f"every {args.interval}s, step budget {cfg.scheduler.max_num_batched_tokens}", rows)
    p99 = results["unchunked"]["itl_p99_ms"] / results["chunked"]["itl_p99_ms"]
    cost = 1 - results["chunked"]["tokens_per_s"] / results["unchunked"]["tokens_per_s"]
    print(f"p99 inter-token latency: {p99:.2f}x lower with chunking; throughput cost {cost:+.1%}")
    write_json(args.output_json, {"results": results, "p99_itl_ratio": p99, "throughput_cost": cost})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("chunked", help="decode streams vs arriving long prompts, chunking on/off")
    p.add_argument("--num-streams", type=int, default=16)
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--long-output-len", type=int, default=4)
    p.add_argument("--num-long", type=int, default=3)
    p.add_argument("--interval", type=float, default=3.0, help="seconds between long prompts")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run)
