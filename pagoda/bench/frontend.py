"""``pagoda bench frontend``: is the HTTP front end the bottleneck?

Runs seeded random-token workloads through ``LLM.generate`` (no HTTP, no IPC) and through
``pagoda serve`` started as a subprocess on a free loopback port, in one command: all prompts of
a round are streamed at once through the OpenAI completions API (token-id prompts, greedy,
``ignore_eos``, ``max_tokens`` set, so both paths produce the same tokens, which is checked).

Both sides first run one full warm-up round of unrelated prompts, so neither pays one-time costs
(allocator growth, first-use initialisation) in the measured rounds; each measured round has
fresh prompts, so neither hits the other rounds' prefix-cache entries. Prints each round and the
ratio of the totals' output token rates; the target is at least 0.9.
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

from pagoda.bench.common import Workload, engine_kwargs, print_table, random_workload, write_json
from pagoda.bench.extras import lazy_import
from pagoda.bench.serve import build_payload, probe_server, run_requests
from pagoda.bench.serve_metrics import compute_summary
from pagoda.config import EngineArgs, EngineConfig

# bench extra, imported on first use (pagoda.bench.extras)
httpx = lazy_import("httpx")

SERVED_NAME = "bench"
SERVER_START_TIMEOUT_S = 600.0
TARGET_RATIO = 0.9
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts share nothing with the measured rounds'


def add_frontend_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``frontend`` under the ``pagoda bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "frontend", help="output tok/s through the HTTP server vs offline LLM.generate",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="also the concurrency: all are sent at once")
    p.add_argument("--input-len", default="32:256", help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", default="32:128", help="MIN:MAX output tokens")
    p.add_argument("--seed", type=int, default=0, help="workload seed (round r uses seed + r)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds, each with fresh prompts")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the full warm-up round (then one-time costs land in round 1)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--server-log", default=None, help="write the server's output here (default: a temp file)")
    EngineArgs.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=run_frontend)
    return p


def run_frontend(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    model, vocab = config.model.path, config.model.vocab_size
    rounds = [random_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed + r)
              for r in range(args.rounds)]
    print(f"workload: {args.rounds} rounds of {args.num_prompts} prompts, input {args.input_len}, "
          f"output {args.output_len}; round 1 has {rounds[0].num_prompt_tokens} prompt / "
          f"{rounds[0].num_output_tokens} output tokens")
    results: list[dict[str, Any]] = []
    with Offline(engine_kwargs(args, model=model)) as offline, \
            Server(model, server_flags(args), args.server_log) as server:
        if args.warmup:
            warm = random_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                                   args.seed + WARMUP_SEED_OFFSET)
            offline.run(warm)
            server.run(warm)
        for work in rounds:
            off, off_texts = offline.run(work)
            srv, srv_texts = server.run(work)
            same = sum(a == b for a, b in zip(off_texts, srv_texts))
            results.append({"offline": off, "server": srv, "identical_outputs": same,
                            "ratio": srv["output_tokens_per_s"] / off["output_tokens_per_s"]})
    ratio = _total_rate(results, "server") / _total_rate(results, "offline")
    rows = [("round", "offline tok/s", "server tok/s", "server / offline", "median TTFT ms",
             "median TPOT ms", "identical")]
    for i, r in enumerate(results, 1):
        rows.append((str(i), f"{r['offline']['output_tokens_per_s']:.1f}", f"{r['server']['output_tokens_per_s']:.1f}",
                     f"{r['ratio']:.3f}", f"{r['server']['median_ttft_ms']:.1f}",
                     f"{r['server']['median_tpot_ms']:.1f}", f"{r['identical_outputs']}/{args.num_prompts}"))
    rows.append(("all", f"{_total_rate(results, 'offline'):.1f}", f"{_total_rate(results, 'server'):.1f}",
                 f"{ratio:.3f}", "-", "-", f"{sum(r['identical_outputs'] for r in results)}/"
                                           f"{args.num_prompts * args.rounds}"))
    print_table(f"frontend: {args.num_prompts} concurrent streams", rows)
    print(f"server / offline output tok/s: {ratio:.3f} (target >= {TARGET_RATIO})")
    write_json(args.output_json, {"workload": {k: getattr(args, k) for k in (
        "num_prompts", "input_len", "output_len", "seed", "rounds", "warmup")},
        "model": model, "rounds": results, "ratio": ratio})
    return 0


def _total_rate(results: list[dict[str, Any]], side: str) -> float:
    return (sum(r[side]["output_tokens"] for r in results) / sum(r[side]["elapsed_s"] for r in results))


# ---- offline ---------------------------------------------------------------------------------

class Offline:
    """One ``LLM`` for every round, as a long-running offline job would keep it."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        from pagoda import LLM

        self.llm = LLM(**kwargs)

    def __enter__(self) -> "Offline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.llm.shutdown()

    def run(self, work: Workload) -> tuple[dict[str, float], list[str]]:
        from pagoda import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
        prompts = [{"prompt_token_ids": p} for p in work.prompts]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
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


class Server:
    """``pagoda serve`` (``model``, or the demo model for None) in a subprocess on a free loopback
    port, stopped with SIGTERM on exit."""

    def __init__(self, model: str | None, flags: Sequence[str], log_path: str | None) -> None:
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="pagoda-bench-"), "server.log")
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *([model] if model else []),
               "--port", str(port),
               "--served-model-name", SERVED_NAME, "--log-level", "warning", *flags]
        print(f"starting: {' '.join(cmd)}  (log: {self.log_path})")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        try:
            _wait_healthy(self.proc, self.base, self.log_path)
            url = self.base + "/v1/completions"
            asyncio.run(probe_server(url, build_payload("completions", SERVED_NAME, [11, 12, 13, 14], 2),
                                     "completions", {}, 600.0))
        except BaseException:
            _stop(self.proc)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _stop(self.proc)

    def run(self, work: Workload) -> tuple[dict[str, float], list[str]]:
        return _drive(self.base, work)


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
