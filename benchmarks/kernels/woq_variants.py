"""The weight-only quantized kernel (pagoda/kernels/csrc/woq.cpp) of each compiled variant side by
side: int8 per channel, int8 in groups of 32 (GGUF Q8_0's numbers; ``q8_0-as-int4x2`` the two int4
products a Q8_0 matrix ran as before that kind) and int4 in groups of 128, over one ``[N, K]``
weight, at several row counts; every variant's call of a case runs back to back (interleaved), the best of ``--reps``
counts, and the ratios to the first variant named are printed (``--torch``: torch's weight-only
ops beside them, which is what the layers ran on AVX2 CPUs before the kernel had AVX2 code). One thread by default: on a
shared machine a two-thread call waits on whichever thread was descheduled, so one thread gives
the steadier ratio.

    python benchmarks/kernels/woq_variants.py --variants avx2,avx512 --shape 2048x768

``avx2-vnni`` and ``avx2-plain`` name the avx2 variant with its AVX-VNNI path on or off (plain
``avx2`` runs whatever this CPU chooses), e.g. ``--variants avx2-plain,avx2-vnni``.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagoda.kernels import build, select
from pagoda.kernels import woq as kwoq
from pagoda.layers.quantization.kernels import make_int4_linear, make_int8_linear


def _cases(n: int, k: int, group: int, group8: int) -> dict[str, tuple[int, list[tuple], object]]:
    """kind name -> (kind, the woq_linear calls' arguments after ``out, x``, torch's op over the same
    weight: what the layers run where the variant has no kernel)."""
    none = torch.empty(0)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8_col = torch.rand(n) * 0.01
    p8, s8 = kwoq.pack_int8(q8)
    q4 = torch.randint(0, 16, (n, k))
    p4 = kwoq.pack_int4(q4)
    scales = torch.rand(k // group, n) * 0.01 + 1e-3
    gs, gb = kwoq.int4_group_terms(scales.T, -8 * scales.T)
    zeros = torch.full((n, k // group), 8.0)
    s8g = (torch.rand(n, k // group8) * 0.01 + 1e-3).half().float()
    p8g, gs8 = kwoq.pack_int8g(q8, s8g)
    # Q8_0 as two int4 planes (q + 128 = 16 hi + lo), as gguf_quant ran it before the grouped kind
    u = (q8.to(torch.int16) + 128).to(torch.uint8)
    planes = [(kwoq.pack_int4(u >> 4), kwoq.int4_group_terms(16 * s8g, -128 * s8g)),
              (kwoq.pack_int4(u & 15), kwoq.int4_group_terms(s8g, 0 * s8g))]
    i32 = none.to(torch.int32)
    return {"int8": (kwoq.KIND_INT8, [(p8, kwoq.KIND_INT8, s8_col, none, none, 0, s8, none)],
                     make_int8_linear(q8, s8_col, backend="torch")),
            f"int8 g{group8}": (kwoq.KIND_INT8G, [(p8g, kwoq.KIND_INT8G, none, gs8, none, group8, i32, none)],
                                make_int8_linear(q8, s8g, None, group8, backend="dequant")),
            "q8_0-as-int4x2": (kwoq.KIND_INT4, [(p, kwoq.KIND_INT4, none, t[0], none if t[1] is None else t[1],
                                                 group8, i32, none) for p, t in planes], None),
            "int4": (kwoq.KIND_INT4, [(p4, kwoq.KIND_INT4, none, gs, gb, group, i32, none)],
                     make_int4_linear(q4, scales.T.contiguous(), zeros, group, backend="torch"))}


def _vnni_wanted(name: str) -> bool | None:
    """``avx2-vnni`` -> True, ``avx2-plain`` -> False, any other name -> None (as chosen)."""
    return {"vnni": True, "plain": False}.get(name.partition("-")[2])


def _call(lib, vnni: bool | None, out: torch.Tensor, x: torch.Tensor, calls: list[tuple]) -> None:
    if vnni is not None and bool(lib.woq_set_vnni(vnni)) != vnni:
        raise SystemExit("this CPU has no AVX-VNNI (avx_vnni), or the variant has no 256-bit VNNI path")
    lib.woq_linear(out, x, *calls[0])
    for rest in calls[1:]:  # products that add (the int4 planes)
        other = torch.empty_like(out)
        lib.woq_linear(other, x, *rest)
        out += other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(v for v in ("avx2", "avx512")
                                                    if v in {select.VARIANT_OF[x] for x in select.supported_levels()}))
    ap.add_argument("--shape", default="2048x768", help="N x K (output x input features)")
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--group", type=int, default=128, help="int4's group size")
    ap.add_argument("--group8", type=int, default=32, help="grouped int8's group size (GGUF Q8_0: 32)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torch", action="store_true", help="also torch's weight-only ops (int8pack / int4pack, "
                    "activations rounded to bfloat16), which the layers use where the variant has no kernel")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, k = (int(v) for v in args.shape.lower().split("x"))
    libs = {v: build.library(v.split("-")[0]) for v in args.variants.split(",")}
    cases = _cases(n, k, args.group, args.group8)
    first = next(iter(libs))
    print(f"[{n}, {k}] weight, {args.threads} thread(s), best of {args.reps} interleaved calls; "
          f"GMAC/s = rows * N * K / time")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k)
        out = torch.empty(rows, n)
        for name, (kind, rest, torch_op) in cases.items():
            run = {v: (lambda lib=lib, vnni=_vnni_wanted(v): _call(lib, vnni, out, x, rest)) for v, lib in libs.items()
                   if lib is not None and lib.woq_has_kind(kind)}
            if args.torch and torch_op is not None:
                run["torch"] = lambda torch_op=torch_op: torch_op(x, None)
            best = dict.fromkeys(run, float("inf"))
            for _ in range(args.reps):
                for v, fn in run.items():
                    start = time.perf_counter()
                    fn()
                    best[v] = min(best[v], time.perf_counter() - start)
            cells = [f"{v} {t * 1e6:8.1f} us {rows * n * k / t / 1e9:6.1f} GMAC/s" for v, t in best.items()]
            ratios = [f"{v}/{first} {best[first] / t:.2f}x" for v, t in best.items() if v != first and first in best]
            print(f"rows {rows:4d} {name}: " + " | ".join(cells + ratios), flush=True)


if __name__ == "__main__":
    main()
