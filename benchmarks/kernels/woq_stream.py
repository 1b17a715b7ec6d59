"""One-row int4/int8 weight-only products streaming from memory: a decode token's worth of distinct
weights (by default the bench preset's 8 layers of q/k/v, o, gate/up and down, and its LM head;
about 34 MB in int4, more than this machine's last-level cache), called in sequence as a batch-1
step does, through one kernel variant. Reports GB/s of the bytes the kernel reads (weights and
per-group / per-channel terms), best of ``--reps``; with one thread the time is the process's CPU
time, so a shared machine's other processes cost less of the figure (their cache and memory
traffic still count).

    python benchmarks/kernels/woq_stream.py --variant avx2-vnni --kind int4 --threads 1

Where ``woq_variants.py`` times one weight that stays in cache (the kernel's arithmetic), this
times what a decode step sees: every weight line a miss, so the prefetching counts.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagoda.kernels import build
from pagoda.kernels import woq as kwoq


def _layer_shapes(hidden: int, inter: int, qkv: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    return [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]


def _case(kind: str, n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, tuple, int]:
    """(x, out, the woq_linear arguments after ``out, x``, bytes read)."""
    none = torch.empty(0)
    if kind == "int4":
        packed = kwoq.pack_int4(torch.randint(0, 16, (n, k)))
        scales = torch.rand(n, k // group) * 0.01 + 1e-3
        gs, gb = kwoq.int4_group_terms(scales, -8 * scales)
        rest = (packed, kwoq.KIND_INT4, none, gs, gb, group, torch.empty(0, dtype=torch.int32), none)
        nbytes = packed.numel() * packed.element_size() + 2 * gs.numel() * gs.element_size()
    else:
        packed, sums = kwoq.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8))
        rest = (packed, kwoq.KIND_INT8, torch.rand(n) * 0.01, none, none, 0, sums, none)
        nbytes = packed.numel() * packed.element_size() + 2 * n * 4
    return torch.randn(1, k), torch.empty(1, n), rest, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="avx2", help="avx2, avx2-vnni, avx2-plain or avx512")
    ap.add_argument("--kind", choices=("int4", "int8"), default="int4")
    ap.add_argument("--shape", default="768,2048,1280,8,8192",
                    help="hidden, intermediate, q+k+v features, layers, vocab (default: the bench preset)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    name, _, path = args.variant.partition("-")
    lib = build.library(name)
    if lib is None or not lib.woq_available():
        raise SystemExit(f"no weight-only kernel in the {name} variant here")
    if path and bool(lib.woq_set_vnni(path == "vnni")) != (path == "vnni"):
        raise SystemExit("this CPU has no AVX-VNNI (avx_vnni), or the variant has no 256-bit VNNI path")
    hidden, inter, qkv, layers, vocab = (int(v) for v in args.shape.split(","))
    cases = [_case(args.kind, n, k, args.group) for n, k in _layer_shapes(hidden, inter, qkv, layers, vocab)]
    nbytes = sum(c[3] for c in cases)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    best = float("inf")
    for _ in range(args.reps):
        start = clock()
        for x, out, rest, _ in cases:
            lib.woq_linear(out, x, *rest)
        best = min(best, clock() - start)
    print(f"{args.variant} {args.kind}: {len(cases)} products, {nbytes / 1e6:.1f} MB, {args.threads} thread(s): "
          f"best {best * 1e3:.2f} ms, {nbytes / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
