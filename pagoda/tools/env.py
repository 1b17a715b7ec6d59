"""``pagoda env``: what this machine runs: the CPU and its features, the kernel variant chosen
(and why), where its library comes from, which kernels it has, and the ``PAGODA_CPU_*`` settings
in force. For bug reports and for checking an install (``--json`` for scripts)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

# The CPU flags the kernel variants care about, shown when present.
_SHOWN_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report() -> dict[str, Any]:
    """Everything ``pagoda env`` prints, as a dict."""
    from pagoda import cpu_features
    from pagoda.kernels import build, select
    from pagoda.omp import threads_reason

    flags = cpu_features.cpu_flags()
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": [f for f in _SHOWN_FLAGS if f in flags],
        "isa_levels_supported": select.supported_levels(),
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("PAGODA_CPU_")},
    }
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["torch_threads"] = f"{torch.get_num_threads()} ({threads_reason()})"
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        out["torch"] = f"unavailable ({exc})"
    try:
        choice = select.isa()
    except ValueError as exc:
        out["isa"] = {"error": str(exc)}
        return out
    out["isa"] = {"level": choice.level, "variant": choice.variant, "reason": choice.reason}
    if not select.kernels_enabled():
        out["kernels"] = "off (PAGODA_CPU_KERNELS=0): the torch paths serve"
        return out
    lib = build.ops()
    out["library"] = build.module(choice.variant).__file__ if lib is not None else "unavailable (see the log above)"
    if lib is not None:
        out["kernels"] = {
            "gemv (few-row products)": True,
            "paged decode attention": True,
            "elementwise ops (norms, rotary, SiLU)": True,
            "MoE experts": True,
            "fused decode blocks": select.fused_decode_enabled(),
            "grammar bitmask": True,
            "weight-only int8 / int4 / fp8": [bool(lib.woq_has_kind(kind)) for kind in (0, 2, 1)],
            "weight-only int8 / int4 on AVX-VNNI (256-bit)": _woq_vnni(),
            "panel matmul float32 / bfloat16": [bool(lib.panel_available()), bool(lib.panel_available_bf16())],
            "AMX bfloat16 tiles": bool(select.amx_allowed() and lib.amx_available()),
        }
    out["linear layers (PAGODA_CPU_GEMM)"] = select.gemm_mode() + (
        ": oneDNN, gemv or the tile kernels, timed per weight shape at start-up" if select.gemm_mode() == "auto" else "")
    out["dtype auto prefers bfloat16"] = cpu_features.prefers_bf16()
    return out


def _woq_vnni() -> bool:
    from pagoda.kernels import woq

    return woq.vnni_active()


def _print(info: dict[str, Any]) -> None:
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        elif isinstance(value, list):
            print(f"{key}: {' '.join(map(str, value)) or '-'}")
        else:
            print(f"{key}: {value}")


def run(args: argparse.Namespace) -> int:
    info = report()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print(info)
    return 0


def add_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("env", help="show the CPU, the kernel variant chosen and why",
                                   description="What this machine runs: CPU features, the kernel variant "
                                               "chosen and why, its library and kernels, PAGODA_CPU_* settings.")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)
