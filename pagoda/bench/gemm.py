"""``pagoda bench gemm``: the model's linear layers through torch's ``F.linear`` and through the
oneDNN packed weights pagoda uses on CPU, side by side at the token counts a serving step has;
beside them the decode kernel of the dtype where this CPU runs it: for a bfloat16 model the AMX
tile kernel (``cpu_amx``) on a CPU with AMX, else the bfloat16 panel kernel on one with
AVX512-BF16; for a float32 model the panel kernel (``cpu_panel``) on a CPU with AVX-512; each at
the row counts it serves (up to its ``MAX_ROWS``)."""
from __future__ import annotations

import argparse

import torch

from pagoda.bench.common import print_table, seconds_per_call, write_json
from pagoda.config import ModelConfig
from pagoda.kernels import amx as cpu_amx
from pagoda.layers import cpu_gemm


def layer_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each distinct linear in one layer, plus the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [("qkv_proj", h, q + 2 * kv), ("o_proj", q, h), ("gate_up_proj", h, 2 * i),
            ("down_proj", i, h), ("lm_head", h, cfg.vocab_size)]


def run(args: argparse.Namespace) -> int:
    if not cpu_gemm.onednn_available():
        print("this torch build has no oneDNN linear ops; nothing to compare")
        return 1
    cfg = ModelConfig.from_pretrained(args.model, None, args.dtype, None, "cpu")
    gen = torch.Generator().manual_seed(0)
    # The decode kernel of this dtype, where it runs here: (module, its name, the JSON key).
    picked = cpu_gemm._tile_kernel(cfg.dtype, "auto")
    kernel = None
    if picked is not None and picked[0].supports(torch.empty(1, 1, dtype=cfg.dtype)):
        kernel = (picked[0], "AMX", "amx") if picked[0] is cpu_amx else (picked[0], "panel", "panel")
    # oneDNN packs bfloat16 only where the CPU has AVX512-BF16 (or AMX); elsewhere (AVX2) the
    # layers keep torch's F.linear, and the columns compare against that.
    packable = cpu_gemm.pack(torch.zeros(16, 16, dtype=cfg.dtype)) is not None
    base = "oneDNN" if packable else "torch"
    header = ["layer", "tokens", "torch GFLOP/s"] + (["oneDNN GFLOP/s", "oneDNN/torch"] if packable else [])
    if kernel:
        header += [f"{kernel[1]} kernel GFLOP/s", f"{kernel[1]}/{base}"]
    rows = [tuple(header)]
    results = []
    total_torch = total_packed = 0.0
    for name, k, n in layer_shapes(cfg):
        # Copies of the weight past the caches' reach, used in turn: a serving step streams every
        # weight of the model between two uses of one, so each product reads its weight from memory.
        first = (torch.randn(n, k, generator=gen) * k ** -0.5).to(cfg.dtype)
        weights = [first] + [(torch.randn(n, k, generator=gen) * k ** -0.5).to(cfg.dtype)
                             for _ in range(cpu_gemm.cold_copies(first) - 1)]
        copies = len(weights)
        packs = [cpu_gemm.pack(w) for w in weights] if packable else []
        tiles = [kernel[0].pack(w) for w in weights] if kernel else []
        for m in args.tokens:
            x = torch.randn(m, k, generator=gen).to(cfg.dtype)
            ref = torch.nn.functional.linear(x, weights[0]).float()
            per_copy = lambda fn: seconds_per_call(fn, args.min_time, warmup=3) / copies  # noqa: E731
            t_torch = per_copy(lambda: [torch.nn.functional.linear(x, w) for w in weights])
            flops = 2 * m * k * n
            row = [name, str(m), f"{flops / t_torch / 1e9:.0f}"]
            result = {"layer": name, "tokens": m, "in": k, "out": n, "torch_s": t_torch}
            t_base = t_torch
            if packable:
                t_base = t_packed = per_copy(lambda: [cpu_gemm.linear(x, weights[0], p, None) for p in packs])
                row += [f"{flops / t_packed / 1e9:.0f}", f"{t_torch / t_packed:.2f}x"]
                diff = cpu_gemm.linear(x, weights[0], packs[0], None).float() - ref
                result.update(onednn_s=t_packed, max_abs_diff=diff.abs().max().item())
                total_torch += t_torch
                total_packed += t_packed
            if kernel and m <= kernel[0].MAX_ROWS:
                mod, _, key = kernel
                t_tiles = per_copy(lambda: [mod.linear(x, t, n, None) for t in tiles])
                row += [f"{flops / t_tiles / 1e9:.0f}", f"{t_base / t_tiles:.2f}x"]
                result[f"{key}_s"] = t_tiles
                result[f"{key}_max_abs_diff"] = (mod.linear(x, tiles[0], n, None).float() - ref).abs().max().item()
            elif kernel:
                row += ["-", "-"]  # past the rows it serves
            rows.append(tuple(row))
            results.append(result)
    print_table(f"linear layers of {args.model} ({cfg.dtype}, {torch.get_num_threads()} threads, "
                "weights from memory)", rows)
    speedup = total_torch / total_packed if packable else None
    if packable:
        print(f"all shapes together: oneDNN packed is {speedup:.2f}x torch's F.linear")
    else:
        print(f"oneDNN cannot pack {cfg.dtype} weights on this CPU (no AVX512-BF16 or AMX): the layers run "
              "torch's F.linear, which the columns compare against")
    write_json(args.output_json, {"model": args.model, "dtype": str(cfg.dtype), "shapes": results,
                                  "onednn": packable, "speedup": speedup})
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("gemm", help="CPU linear layers: torch F.linear against oneDNN packed (and the AMX or panel kernel)")
    p.add_argument("--model", required=True, help="model directory (its config.json gives the shapes)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64, 256, 512],
                   help="comma-separated token counts (rows per matmul)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds to time each case")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
