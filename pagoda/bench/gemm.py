"""``pagoda bench gemm``: the model's linear layers through torch's ``F.linear`` and through the
oneDNN packed weights pagoda uses on CPU, side by side at the token counts a serving step has."""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from pagoda.bench.common import print_table, write_json
from pagoda.config import ModelConfig
from pagoda.layers import cpu_gemm


def layer_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each distinct linear in one layer, plus the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [("qkv_proj", h, q + 2 * kv), ("o_proj", q, h), ("gate_up_proj", h, 2 * i),
            ("down_proj", i, h), ("lm_head", h, cfg.vocab_size)]


def _seconds(fn: Callable[[], torch.Tensor], min_time: float) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / n


def run(args: argparse.Namespace) -> int:
    if not cpu_gemm.onednn_available():
        print("this torch build has no oneDNN linear ops; nothing to compare")
        return 1
    cfg = ModelConfig.from_pretrained(args.model, None, args.dtype, None, "cpu")
    gen = torch.Generator().manual_seed(0)
    rows = [("layer", "tokens", "torch GFLOP/s", "oneDNN GFLOP/s", "speed-up")]
    results = []
    total_torch = total_packed = 0.0
    for name, k, n in layer_shapes(cfg):
        weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(cfg.dtype)
        packed = cpu_gemm.pack(weight)
        if packed is None:
            print(f"oneDNN cannot pack {cfg.dtype} weights on this CPU")
            return 1
        for m in args.tokens:
            x = torch.randn(m, k, generator=gen).to(cfg.dtype)
            diff = (cpu_gemm.linear(x, weight, packed, None).float() - torch.nn.functional.linear(x, weight).float())
            t_torch = _seconds(lambda: torch.nn.functional.linear(x, weight), args.min_time)
            t_packed = _seconds(lambda: cpu_gemm.linear(x, weight, packed, None), args.min_time)
            flops = 2 * m * k * n
            rows.append((name, str(m), f"{flops / t_torch / 1e9:.0f}", f"{flops / t_packed / 1e9:.0f}",
                         f"{t_torch / t_packed:.2f}x"))
            results.append({"layer": name, "tokens": m, "in": k, "out": n, "torch_s": t_torch,
                            "onednn_s": t_packed, "max_abs_diff": diff.abs().max().item()})
            total_torch += t_torch
            total_packed += t_packed
    print_table(f"linear layers of {args.model} ({cfg.dtype}, {torch.get_num_threads()} threads)", rows)
    print(f"all shapes together: oneDNN packed is {total_torch / total_packed:.2f}x torch's F.linear")
    write_json(args.output_json, {"model": args.model, "dtype": str(cfg.dtype), "shapes": results,
                                  "speedup": total_torch / total_packed})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("gemm", help="CPU linear layers: torch F.linear against oneDNN packed")
    p.add_argument("--model", required=True, help="model directory (its config.json gives the shapes)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64, 256, 512],
                   help="comma-separated token counts (rows per matmul)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds to time each case")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
