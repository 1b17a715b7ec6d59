"""``pagoda bench decode-blocks``: decode time per step with the fused CPU decode blocks
(``pagoda.models.cpu_decode``) and without them, in one engine and one run.

The engine is built once; each round generates the same greedy batch twice, once with every
layer's blocks attached and once with them detached (the layers then run op by op), in
alternating order, so both sides see the same machine state. Prints the median time per decode
step of each, their ratio, and whether the greedy tokens were the same.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagoda.bench.common import print_table, write_json


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams
    from pagoda.models.decoder import DecoderLayer

    kwargs = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(args.model, enable_prefix_caching=False, max_num_seqs=max(args.batch_sizes), **kwargs)
    runner = llm.engine.core.executor
    layers = [m for m in runner.model.modules() if isinstance(m, DecoderLayer)]
    blocks = [layer.cpu_decode for layer in layers]
    fused = sum(b is not None for b in blocks)
    with_mlp = sum(b is not None and b.mlp is not None for b in blocks)
    print(f"{fused} of {len(layers)} layers have fused blocks ({with_mlp} with their MLP)")
    if not fused:
        print("nothing to compare: no layer qualifies here (see pagoda/models/cpu_decode.py)")
        return 1
    rng = random.Random(args.seed)
    vocab = runner.model.config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rows, results = [], []
    for size in args.batch_sizes:
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]}
                   for _ in range(size)]
        times: dict[str, list[float]] = {"on": [], "off": []}
        tokens: dict[str, list] = {}
        for r in range(args.rounds + 1):  # round 0 warms up
            for mode in (("on", "off") if r % 2 else ("off", "on")):
                for layer, block in zip(layers, blocks):
                    layer.cpu_decode = block if mode == "on" else None
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if r:
                    times[mode].append((time.perf_counter() - start) / args.output_len)
                tokens[mode] = [o.outputs[0].token_ids for o in outs]
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        same = tokens["on"] == tokens["off"]
        rows.append((str(size), f"{off * 1e3:.2f}", f"{on * 1e3:.2f}", f"{on / off:.3f}", "yes" if same else "NO"))
        results.append({"batch": size, "off_s_per_step": off, "on_s_per_step": on, "ratio": on / off,
                        "same_tokens": same})
    for layer, block in zip(layers, blocks):
        layer.cpu_decode = block
    llm.shutdown()
    print_table(f"{args.model}{' ' + args.quantization if args.quantization else ''}: ms per decode step "
                f"(input {args.input_len}, output {args.output_len}, median of {args.rounds} rounds)",
                [("batch", "op by op", "fused blocks", "fused / op by op", "same tokens")] + rows)
    write_json(args.output_json, {"model": args.model, "quantization": args.quantization, "results": results})
    return 0 if all(r["same_tokens"] for r in results) else 1


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("decode-blocks", help="CPU decode steps with and without the fused layer blocks")
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default=None, help="online quantization (int8, int4, fp8)")
    p.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
