"""``pagoda bench lora``: the throughput cost of serving LoRA adapters.

One engine (``--enable-lora``, ``--max-loras`` = the most adapters tried) runs the same batch
(``--num-prompts`` requests, 32 by default) with every request on the base model, then with
the requests spread round-robin over 1, 4 and 16 random rank-16 adapters that target all seven
projections. Rounds alternate between the configurations and the best of ``--rounds`` counts,
so a noisy neighbour hurts every configuration alike; the prefix cache is emptied before each
run. The cost is ``1 - throughput / base throughput``. A second engine without
``--enable-lora`` gives the plain base model's figure too.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from pagoda.bench.common import add_engine_args, engine_kwargs, print_table, random_workload, write_json


def _timed(llm: Any, prompts: list, params: list, loras: list | None) -> float:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(p.max_tokens for p in params)
    return elapsed


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM, LoRARequest, SamplingParams
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.tools.make_lora import write_random_lora

    counts = sorted({int(c) for c in args.adapters.split(",")})
    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    work = random_workload(args.num_prompts, args.input_len, args.output_len, config.model.vocab_size, args.seed)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    tmp = tempfile.TemporaryDirectory(prefix="pagoda-bench-lora-")
    paths = [write_random_lora(config.model.path, Path(tmp.name) / f"a{i}", r=args.rank, seed=i)
             for i in range(max(counts))]
    adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    runs: dict[str, list | None] = {"base": None}
    for n in counts:
        runs[f"{n} adapter{'s' if n > 1 else ''}"] = [adapters[i % n] for i in range(len(prompts))]
    kwargs = engine_kwargs(args, model=config.model.path, enable_lora=True, max_loras=max(counts),
                           max_lora_rank=args.rank, max_cpu_loras=max(counts))
    best: dict[str, float] = {}
    llm = LLM(**kwargs)
    try:
        for loras in runs.values():  # warm-up: every adapter placed once, every shape seen
            llm.generate(prompts[:4], params[:4], use_tqdm=False, lora_request=loras[:4] if loras else None)
        for r in range(args.rounds):
            for name, loras in runs.items():
                elapsed = _timed(llm, prompts, params, loras)
                best[name] = min(best.get(name, elapsed), elapsed)
                print(f"round {r + 1}: {name}: {elapsed:.2f} s", flush=True)
    finally:
        llm.shutdown()
        tmp.cleanup()
    if not args.skip_plain:
        plain = LLM(**engine_kwargs(args, model=config.model.path, enable_lora=False))
        try:
            plain.generate(prompts[:4], params[:4], use_tqdm=False)
            best["base, no --enable-lora"] = min(_timed(plain, prompts, params, None) for _ in range(args.rounds))
        finally:
            plain.shutdown()
    return _report(args, work, best)


def _report(args: argparse.Namespace, work: Any, best: dict[str, float]) -> int:
    tokens = work.num_output_tokens
    base = tokens / best["base"]
    rows = [("run", "output tok/s", "seconds", "cost vs base")]
    results = {}
    for name, elapsed in best.items():
        tput = tokens / elapsed
        cost = 1 - tput / base
        results[name] = {"elapsed_s": elapsed, "output_tokens_per_s": tput, "cost": cost}
        rows.append((name, f"{tput:.1f}", f"{elapsed:.2f}", f"{100 * cost:+.1f}%"))
    print_table(f"LoRA cost: {args.num_prompts} requests, input {args.input_len}, output {args.output_len}, "
                f"rank {args.rank}, all 7 projections", rows)
    four = results.get("4 adapters")
    if four is not None:
        verdict = "met" if four["cost"] <= 0.25 else "NOT met"
        print(f"bar (<= 25% throughput cost with 4 adapters): {verdict} ({100 * four['cost']:.1f}%)")
    write_json(args.output_json, {"workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len",
                                                                             "rank", "seed", "rounds")},
                                  "results": results})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("lora", help="throughput cost of LoRA adapters against the base model")
    p.add_argument("--num-prompts", type=int, default=32, help="the batch: requests submitted together")
    p.add_argument("--input-len", default="64", help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", default="64", help="MIN:MAX output tokens")
    p.add_argument("--adapters", default="1,4,16", help="adapter counts to spread the requests over")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration; the fastest counts")
    p.add_argument("--skip-plain", action="store_true", help="no run of an engine without --enable-lora")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0, help="workload seed")
    add_engine_args(p)
    p.set_defaults(func=run)
