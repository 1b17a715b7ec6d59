"""``pagoda bench frontend``: is the HTTP front end the bottleneck?

Runs one seeded random-token workload twice in one command: first offline through
``LLM.generate`` (no HTTP, no IPC), then through ``pagoda serve`` started as a subprocess on a
free loopback port, all prompts streamed at once through the OpenAI completions API (token-id
prompts, greedy, ``ignore_eos``, ``max_tokens`` set, so both runs produce the same tokens).
Prints both output token rates and their ratio; the target is a ratio of at least 0.9.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import httpx

from pagoda.bench.common import Workload, engine_kwargs, print_table, random_workload, write_json
from pagoda.bench.serve import build_payload, probe_server, run_requests
from pagoda.bench.serve_metrics import compute_summary
from pagoda.config import EngineArgs, EngineConfig

SERVED_NAME = "bench"
SERVER_START_TIMEOUT_S = 600.0
TARGET_RATIO = 0.9


def add_frontend_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``frontend`` under the ``pagoda bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "frontend", help="output tok/s through the HTTP server vs offline LLM.generate",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="also the concurrency: all are sent at once")
    p.add_argument("--input-len", default="32:256", help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", default="32:128", help="MIN:MAX output tokens")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output-json", default=None)
    p.add_argument("--server-log", default=None, help="write the server's output here (default: a temp file)")
    EngineArgs.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=run_frontend)
    return p


def run_frontend(args: argparse.Namespace) -> int:
    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    model = config.model.path
    work = random_workload(args.num_prompts, args.input_len, args.output_len, config.model.vocab_size, args.seed)
    print(f"workload: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"{work.num_prompt_tokens} prompt / {work.num_output_tokens} output tokens")
    offline, offline_texts = run_offline(engine_kwargs(args, model=model), work)
    server, server_texts = run_server(model, server_flags(args), work, args.server_log)
    same = sum(a == b for a, b in zip(offline_texts, server_texts))
    ratio = server["output_tokens_per_s"] / offline["output_tokens_per_s"]
    rows = [("run", "output tok/s", "seconds", "median TTFT ms", "median TPOT ms"),
            ("offline LLM.generate", f"{offline['output_tokens_per_s']:.1f}", f"{offline['elapsed_s']:.2f}", "-", "-"),
            ("HTTP server", f"{server['output_tokens_per_s']:.1f}", f"{server['elapsed_s']:.2f}",
             f"{server['median_ttft_ms']:.1f}", f"{server['median_tpot_ms']:.1f}")]
    print_table(f"frontend: {args.num_prompts} concurrent streams", rows)
    print(f"server / offline output tok/s: {ratio:.3f} (target >= {TARGET_RATIO}); "
          f"identical outputs: {same}/{len(work.prompts)}")
    write_json(args.output_json, {"workload": {k: getattr(args, k) for k in ("num_prompts", "input_len",
                                                                              "output_len", "seed")},
                                  "model": model, "offline": offline, "server": server, "ratio": ratio,
                                  "identical_outputs": same})
    return 0


# ---- offline ---------------------------------------------------------------------------------

def run_offline(kwargs: dict[str, Any], work: Workload) -> tuple[dict[str, float], list[str]]:
    from pagoda import LLM, SamplingParams

    llm = LLM(**kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as the server gets one
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed}, \
        [o.outputs[0].text for o in outs]


# ---- through the server ----------------------------------------------------------------------

def server_flags(args: argparse.Namespace) -> list[str]:
    """The engine options given on this command line, as ``pagoda serve`` flags."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name, f.default)
        if f.name in ("model", "seed") or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_server(model: str, flags: Sequence[str], work: Workload,
               log_path: str | None) -> tuple[dict[str, float], list[str]]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="pagoda-bench-"), "server.log")
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", model, "--port", str(port),
           "--served-model-name", SERVED_NAME, "--log-level", "warning", *flags]
    print(f"starting: {' '.join(cmd)}  (log: {log_path})")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, base, log_path)
        return _drive(base, work)
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, base: str, log_path: str) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not healthy after {SERVER_START_TIMEOUT_S:.0f} s; see {log_path}")


def _drive(base: str, work: Workload) -> tuple[dict[str, float], list[str]]:
    url = base + "/v1/completions"
    payloads = [build_payload("completions", SERVED_NAME, p, n, temperature=0.0, ignore_eos=True)
                for p, n in zip(work.prompts, work.output_lens)]
    asyncio.run(probe_server(url, build_payload("completions", SERVED_NAME, work.prompts[0][:4], 2), "completions",
                             {}, 600.0))  # warm-up
    results, duration, _ = asyncio.run(run_requests(url, payloads, [len(p) for p in work.prompts],
                                                    [0.0] * len(payloads), "completions", disable_tqdm=True))
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    summary = compute_summary(results, duration)
    produced = sum(r.output_tokens for r in results)
    return {"elapsed_s": duration, "output_tokens": produced, "output_tokens_per_s": produced / duration,
            "median_ttft_ms": summary.ttft.median, "median_tpot_ms": summary.tpot.median}, \
        [r.generated_text for r in results]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
