"""``pagoda bench moe``: the mixture-of-experts layer's decode step beside a dense MLP with the
same active parameters, then a small MoE model's end-to-end decode beside its dense equivalent.

Layer part: a router (``hidden -> experts``), top-k softmax routing and pagoda's grouped
experts (``FusedMoE``: tokens grouped by expert, one product per active expert; on a CPU the
grouped C++ kernel of ``cpu_moe.py``) against one
SiLU-gated MLP of intermediate size ``top_k * expert_intermediate`` (what one token computes
in the MoE), at each batch size, in one run; the ratio MoE / dense is printed. At batch 1 the
MoE reads only ``top_k`` experts; at batch 32 nearly every expert is active, so it reads
``experts / top_k`` times the dense MLP's weights for the same arithmetic: grouping keeps the
arithmetic dense (one matmul per expert, not per token), the extra weight traffic remains.
Both sides run in the same process with the same dtype and threads, in the layouts the engine
uses, warmed up, their calls interleaved (so each side's weights are as cold or warm as the
other's: the MoE's calls stream its experts through the caches between the dense calls), and the
medians compared. The batch-32 ratio is printed against the issue's bar, ``BAR``.

Model part: two random-weight checkpoints of the same attention shapes, Mixtral-shaped and a
Llama with ``intermediate = top_k * expert_intermediate``, decoding the same batch of requests.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from pagoda.bench.common import print_table, write_json
from pagoda.layers import cpu_gemm
from pagoda.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagoda.layers.moe import FusedMoE, softmax_topk
from pagoda.layers.norm_rope_act import SiluAndMul


BAR = 1.5  # MoE / dense at batch 32


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median time of each function, the calls interleaved so load drifts hit all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(3):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


class _Dense(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = MergedColumnParallelLinear(hidden, [inter, inter], False, dtype)
        self.down = RowParallelLinear(inter, hidden, False, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class _MoE(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = ReplicatedLinear(hidden, experts, False, dtype)
        self.experts = FusedMoE(experts, hidden, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, True)
        return self.experts(x, weights, ids)


def _init(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def bench_layer(args: argparse.Namespace, device: torch.device) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.device(device):
        moe = _MoE(args.hidden_size, args.expert_intermediate_size, args.num_experts, args.top_k, dtype)
        dense = _Dense(args.hidden_size, args.top_k * args.expert_intermediate_size, dtype)
    _init(moe, gen)
    _init(dense, gen)
    fns = {"moe": moe, "dense": dense}
    if device.type == "cpu" and args.compare_onednn:  # the same experts through per-expert oneDNN calls
        fns["moe_onednn"] = copy.deepcopy(moe)
        fns["moe_onednn"].experts.pack_weight(grouped_kernel=False)
    if device.type == "cpu":  # the layouts the engine runs with
        cpu_gemm.pack_model(moe)
        cpu_gemm.pack_model(dense)
    results = []
    args.experts_path = _experts_path(moe)
    with torch.inference_mode():
        for batch in args.batch_sizes:
            x = torch.randn(batch, args.hidden_size, generator=gen).to(device=device, dtype=dtype)
            t = _median_seconds({name: (lambda m=m: m(x)) for name, m in fns.items()}, args.repeats)
            active = len(set(softmax_topk(moe.gate(x), args.top_k, True)[1].flatten().tolist()))
            results.append({"batch": batch, "moe_s": t["moe"], "dense_s": t["dense"], "ratio": t["moe"] / t["dense"],
                            "active_experts": active, "moe_onednn_s": t.get("moe_onednn")})
    return results


def _experts_path(moe: torch.nn.Module) -> str:
    fused = moe.experts
    if fused.panels is not None:
        return "grouped C++ kernel"
    return "oneDNN per expert" if fused.packed is not None else "torch per expert (or Triton on a GPU)"


def _make_models(args: argparse.Namespace, root: Path) -> tuple[Path, Path]:
    from pagoda.tools.make_model import make_model

    shape = dict(hidden_size=args.model_hidden_size, num_layers=args.model_layers, num_heads=8, num_kv_heads=4,
                 vocab_size=4096, max_position_embeddings=1024)
    moe = make_model(root / "moe", arch="mixtral", intermediate_size=args.model_expert_intermediate_size,
                     extra_config=dict(num_local_experts=args.num_experts, num_experts_per_tok=args.top_k), **shape)
    dense = make_model(root / "dense", arch="llama",
                       intermediate_size=args.top_k * args.model_expert_intermediate_size, **shape)
    return moe, dense


def _decode_tok_s(model: Path, args: argparse.Namespace) -> float:
    from pagoda import LLM, SamplingParams

    llm = LLM(str(model), kv_cache_memory=256 << 20, max_model_len=1024)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(16, 4096, (args.prompt_len,), generator=gen).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    layer = bench_layer(args, device)
    rows = [("batch", "active experts", "MoE ms", "dense ms", "MoE / dense")]
    if layer[0]["moe_onednn_s"] is not None:
        rows[0] += ("MoE oneDNN-per-expert ms", "its / dense")
    for r in layer:
        rows.append((str(r["batch"]), f"{r['active_experts']}/{args.num_experts}", f"{r['moe_s'] * 1e3:.3f}",
                     f"{r['dense_s'] * 1e3:.3f}", f"{r['ratio']:.2f}x"))
        if r["moe_onednn_s"] is not None:
            rows[-1] += (f"{r['moe_onednn_s'] * 1e3:.3f}", f"{r['moe_onednn_s'] / r['dense_s']:.2f}x")
    print_table(f"one MoE layer's decode step ({args.num_experts} experts, top-{args.top_k}, hidden "
                f"{args.hidden_size}, expert intermediate {args.expert_intermediate_size}, {args.dtype}) against "
                f"a dense MLP of intermediate {args.top_k * args.expert_intermediate_size}, "
                f"{torch.get_num_threads()} threads, experts: {args.experts_path}", rows)
    for r in layer:
        if r["batch"] == 32:
            verdict = "met" if r["ratio"] <= BAR else "not met"
            print(f"bar: MoE / dense at batch 32 <= {BAR}x: {r['ratio']:.2f}x, {verdict}")
    payload: dict = {"layer": layer, "args": {k: v for k, v in vars(args).items() if k != "func"}}
    if not args.skip_model:
        with tempfile.TemporaryDirectory() as tmp:
            moe_dir, dense_dir = _make_models(args, Path(tmp))
            moe_tps, dense_tps = _decode_tok_s(moe_dir, args), _decode_tok_s(dense_dir, args)
        print_table(f"end-to-end decode ({args.num_prompts} requests x {args.output_len} tokens, "
                    f"{args.model_layers} layers, hidden {args.model_hidden_size})", [
                        ("model", "decode tok/s"), ("MoE (mixtral)", f"{moe_tps:.1f}"),
                        ("dense equivalent (llama)", f"{dense_tps:.1f}"), ("MoE / dense", f"{moe_tps / dense_tps:.2f}")])
        payload["model"] = {"moe_tok_s": moe_tps, "dense_tok_s": dense_tps}
    write_json(args.output_json, payload)
    return 0


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("moe", help="MoE layer and model decode against a dense equivalent")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--expert-intermediate-size", type=int, default=1024)
    p.add_argument("--batch-sizes", type=ints, default=[1, 32])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-model", action="store_true", help="only the layer comparison")
    p.add_argument("--compare-onednn", action="store_true",
                   help="also time the experts through per-expert oneDNN calls (the path without the C++ kernel)")
    p.add_argument("--model-hidden-size", type=int, default=512)
    p.add_argument("--model-layers", type=int, default=4)
    p.add_argument("--model-expert-intermediate-size", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
