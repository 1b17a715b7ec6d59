"""``pagoda bench gpu``: the command, assembled from the subcommands each measurement module
defines beside its code (``gpu``: roofline, throughput; ``gpu_attention``; ``gpu_kernels``; ``gpu_all``). Only
this module imports all of them, so they import ``gpu`` and never the other way round."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pagoda.bench import gpu, gpu_all, gpu_attention, gpu_kernels


def needs_cuda(run: Any) -> Any:
    def guarded(args: argparse.Namespace) -> int:
        reason = gpu.cuda_missing()
        if reason is not None:
            print(reason, file=sys.stderr)
            return 2
        return run(args)

    return guarded


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser("gpu", help="GPU roofline, throughput against HF, attention backends, all "
                                                     "of them in one budgeted run (needs CUDA)")
    sub = parser.add_subparsers(dest="gpu_command", metavar="NAME", required=True)
    gpu.add_parsers(sub, needs_cuda)
    gpu_attention.add_parser(sub, needs_cuda)
    gpu_kernels.add_parser(sub, needs_cuda)
    gpu_all.add_parser(sub, needs_cuda)
