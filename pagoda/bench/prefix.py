"""``pagoda bench prefix``: K shared system prompts x M questions, prefix cache on and off in one
run; and an all-unique workload to show what the cache costs when nothing can hit."""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from pagoda.bench.common import FIRST_ORDINARY_ID, add_engine_args, engine_kwargs, print_table, write_json


def shared_prefix_workload(groups: int, per_group: int, prefix_len: int, question_len: int, vocab: int,
                           seed: int) -> tuple[list[list[int]], float]:
    """Prompts in arrival order (groups interleaved) and the ideal hit fraction: the prompt tokens a
    perfect cache could reuse (every group's prefix after its first request) over all prompt tokens."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [draw(prefix_len) for _ in range(groups)]
    prompts = [prefixes[i % groups] + draw(question_len) for i in range(groups * per_group)]
    reusable = groups * (per_group - 1) * prefix_len
    return prompts, reusable / sum(len(p) for p in prompts)


def unique_workload(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + 1)
    return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(length)] for _ in range(count)]


def measure(kwargs: dict[str, Any], prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from pagoda import LLM, SamplingParams

    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [FIRST_ORDINARY_ID + 1] * 8}], params, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    before = llm.engine.core.stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    stats = llm.engine.core.stats()
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    llm.shutdown()
    total_prompt = sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "requests_per_s": len(prompts) / elapsed, "hit_rate": hits / queries if queries else 0.0,
            "prefill_tokens_computed": total_prompt - hits, "mean_ttft_s": statistics.mean(ttfts)}


def run(args: argparse.Namespace) -> int:
    if args.multi_turn:  # conversations that come back after other traffic evicted them
        from pagoda.bench import kv_tiers

        return kv_tiers.run(argparse.Namespace(**{**vars(args), "conversations": args.num_groups,
                                                  "rounds": args.per_group, "prefix_len": args.prefix_len or 0}))
    from pagoda.config import EngineArgs, EngineConfig

    args.prefix_len = args.prefix_len or 1000

    base = engine_kwargs(args)
    vocab = EngineConfig.from_args(EngineArgs.from_namespace(args)).model.vocab_size
    prompts, ideal = shared_prefix_workload(args.num_groups, args.per_group, args.prefix_len, args.question_len,
                                            vocab, args.seed)
    shared = {"on": measure({**base, "enable_prefix_caching": True}, prompts, args.output_len),
              "off": measure({**base, "enable_prefix_caching": False}, prompts, args.output_len)}
    unique = unique_workload(len(prompts), args.prefix_len // 4 + args.question_len, vocab, args.seed)
    plain = {"on": measure({**base, "enable_prefix_caching": True}, unique, args.output_len),
             "off": measure({**base, "enable_prefix_caching": False}, unique, args.output_len)}
    rows = [("workload", "cache", "hit rate", "ideal", "prefill tokens", "out tok/s", "mean TTFT s")]
    for name, res, ideal_rate in (("shared prefix", shared, ideal), ("all unique", plain, 0.0)):
        for mode in ("on", "off"):
            r = res[mode]
            rows.append((name, mode, f"{r['hit_rate']:.3f}", f"{ideal_rate:.3f}", str(r["prefill_tokens_computed"]),
                         f"{r['output_tokens_per_s']:.1f}", f"{r['mean_ttft_s']:.3f}"))
    print_table(f"prefix cache: {args.num_groups} prefixes x {args.per_group} questions, prefix {args.prefix_len}, "
                f"question {args.question_len}, output {args.output_len}", rows)
    speedup = shared["on"]["output_tokens_per_s"] / shared["off"]["output_tokens_per_s"]
    unique_cost = 1 - plain["on"]["output_tokens_per_s"] / plain["off"]["output_tokens_per_s"]
    hit_vs_ideal = shared["on"]["hit_rate"] / ideal
    print(f"shared prefix: throughput cache on / off = {speedup:.2f}x; hit rate = {hit_vs_ideal:.1%} of ideal")
    print(f"all unique: cache-on throughput cost = {unique_cost:+.1%}")
    write_json(args.output_json, {"shared": shared, "unique": plain, "ideal_hit_rate": ideal,
                                  "hit_rate_vs_ideal": hit_vs_ideal, "throughput_ratio_on_off": speedup,
                                  "unique_cost": unique_cost, "args": {k: getattr(args, k) for k in (
                                      "num_groups", "per_group", "prefix_len", "question_len", "output_len")}})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("prefix", help="shared-prefix workload with the prefix cache on and off")
    p.add_argument("--num-groups", type=int, default=8, help="distinct shared prefixes (system prompts)")
    p.add_argument("--per-group", type=int, default=8, help="questions per prefix")
    p.add_argument("--prefix-len", type=int, default=None,
                   help="prefix tokens (default 1000; with --multi-turn: fill max_model_len)")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    p.add_argument("--multi-turn", action="store_true",
                   help="conversations (--num-groups, each asked --per-group questions round-robin) that return "
                        "after other traffic evicted their prefix: the KV tiers (host, disk) against "
                        "recomputation and a device cache holding everything, in one run (= pagoda bench kv-tiers)")
    p.add_argument("--device-blocks", type=int, default=40, help="--multi-turn: device KV blocks (about one "
                   "conversation) when --kv-cache-memory is not given")
    p.add_argument("--cpu-bytes", type=int, default=256 << 20, help="--multi-turn: host tier budget")
    p.add_argument("--with-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="--multi-turn: also measure a disk-only tier")
    add_engine_args(p)
    p.set_defaults(func=run)
