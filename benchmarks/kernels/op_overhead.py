"""The per-call cost of the kernel library's op table (``torch.ops.<namespace>``, csrc/bindings.cpp):
tiny calls whose work is a few hundred nanoseconds, so their time is the call itself, and the fused
decode stack's one call per step and per-layer block calls on a 2-layer, 64-wide model at batch 1.

Run from the repository root: ``python benchmarks/kernels/op_overhead.py [--calls 10000]``. One
intra-op thread (the thread pool's wake-up would otherwise dominate a call this small). Prints the
median and the best of ``--reps`` runs of ``--calls`` calls, in microseconds per call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]


def _time(fn: Callable[[], object], calls: int, reps: int) -> tuple[float, float]:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs), min(runs)


def _decode_args(ops) -> tuple:
    """The arguments of one batch-1 ``decode_layers`` call of a tiny llama (captured from a real step)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import MODEL_SPECS

    from pagoda import LLM, SamplingParams
    from pagoda.tools.make_model import make_model

    model_dir = make_model(Path(tempfile.mkdtemp()), **MODEL_SPECS["llama"])
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=256)
    stack = llm.engine.core.executor.model.model.cpu_decode_stack
    assert stack is not None, "the fused decode stack did not attach"
    captured: list[tuple] = []

    class Capture:
        def __getattr__(self, name):
            def call(*args):
                if name == "decode_layers" and not captured:
                    captured.append(args)
                return getattr(ops, name)(*args)
            return call

    stack.module = Capture()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    stack.module = ops
    return llm, captured[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pagoda.kernels import build
    from pagoda.kernels import gemv as kgemv

    ops = build.ops()
    assert ops is not None, "no kernel library"
    x, w = torch.randn(1, 64), torch.randn(64, 64)
    h, nw, logits = torch.randn(1, 64), torch.ones(64), torch.randn(1, 512)
    gemv_overload = ops.gemv.default
    cases: dict[str, Callable[[], object]] = {
        "gemv 1x64x64 (torch.ops packet)": lambda: ops.gemv(x, w),
        "gemv 1x64x64 (OpOverload .default)": lambda: gemv_overload(x, w),
        "gemv 1x64x64 (kernels.gemv wrapper)": lambda: kgemv.gemv(x, w, None),
        "rms_norm 1x64": lambda: ops.rms_norm(h, nw, 1e-6),
        "greedy_tokens 1x512": lambda: ops.greedy_tokens(logits, [0]),
    }
    round_steps = args.calls * args.reps + 300
    rnd = ops.greedy_round(torch.tensor([3]), torch.tensor([5]), torch.tensor([5], dtype=torch.int32),
                           torch.tensor([6], dtype=torch.int32), torch.tensor([5]),
                           torch.zeros(1, 4, dtype=torch.int32), 16, None, [[7]], round_steps)
    step = rnd.step
    cases["GreedyRound.step 1x512 (class method)"] = lambda: step(logits, False)
    llm, (attn, mlp, xd, residual, pos, slots, tables, lens, bf16, final_w, eps) = _decode_args(ops)
    cases["decode_layers, 2 layers, batch 1"] = lambda: ops.decode_layers(
        attn, mlp, xd, residual, pos, slots, tables, lens, bf16, final_w, eps)

    def per_layer() -> None:
        out, res = ops.decode_attn_block(attn[0], xd, None, pos, slots, tables, lens)
        ops.decode_mlp_block(mlp[0], out, res, False)

    cases["decode_attn_block + decode_mlp_block, 1 layer"] = per_layer
    print(f"library {build.module(build.variant_of(ops)).__file__}, 1 thread, {args.calls} calls x {args.reps}")
    for name, fn in cases.items():
        median, best = _time(fn, args.calls, args.reps)
        print(f"{name:48s} {median:8.2f} us/call (best {best:.2f})")
    llm.shutdown()


if __name__ == "__main__":
    main()
