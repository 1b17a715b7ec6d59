"""``pagoda bench kv-restart``: after a restart, how much of a known long prefix the first
request finds cached in the persistent KV tiers (local disk, Redis).

Per tier: an engine with that tier serves ``prefix + question 1`` (cold) and ``prefix +
question 2`` (a device hit), and shuts down (what it still owes the tier is written). A new
engine on the same tier then serves ``prefix + question 2`` as its first request: its cached
fraction (cached prompt tokens / prompt tokens), its TTFT beside the cold request's, and
whether its output equals the first engine's. Redis is the ``--redis-url`` given, or else a
``redis-server`` started here on 127.0.0.1 (skipped, with a line, when there is none)."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any, Iterator

from pagoda.bench.common import FIRST_ORDINARY_ID, add_engine_args, engine_kwargs, print_table, write_json

NO_TIERS = {"kv_offload_cpu_bytes": None, "kv_offload_disk_path": None, "kv_offload_disk_bytes": None,
            "kv_offload_redis_url": None}


@contextlib.contextmanager
def local_redis(workdir: str) -> Iterator[str | None]:
    """A throwaway ``redis-server`` on a free loopback port (its URL), or None without one."""
    server = shutil.which("redis-server")
    if server is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def one(llm: Any, prompt: list[int], params: Any) -> tuple[float, int, list[int]]:
    """TTFT (s), cached prompt tokens and output tokens of one request."""
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time, out.num_cached_tokens, out.outputs[0].token_ids


def measure(kwargs: dict[str, Any], prefix: list[int], questions: list[list[int]], output_len: int) -> dict[str, Any]:
    """The first engine's two requests, then the restarted engine's first one."""
    from pagoda import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    first = LLM(**kwargs)
    try:
        cold_ttft, _, _ = one(first, prefix + questions[0], params)
        _, _, want = one(first, prefix + questions[1], params)
    finally:
        first.shutdown()
    restarted = LLM(**kwargs)
    try:
        ttft, cached, got = one(restarted, prefix + questions[1], params)
        hits = dict(restarted.engine.core.stats().kv_offload)
    finally:
        restarted.shutdown()
    prompt_len = len(prefix) + len(questions[1])
    return {"cached_tokens": cached, "prompt_tokens": prompt_len, "cached_fraction": cached / prompt_len,
            "ttft_s": ttft, "cold_ttft_s": cold_ttft, "identical": got == want, "kv_offload": hits}


def run(args: argparse.Namespace) -> int:
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.tools.make_model import demo_model_path

    if not args.model:
        args.model = str(demo_model_path())  # random weights, 2,048 positions: room for the prefix
    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(FIRST_ORDINARY_ID, config.model.vocab_size) for _ in range(n)]  # noqa: E731
    prefix, questions = draw(args.prefix_len), [draw(args.question_len), draw(args.question_len)]
    base = {**engine_kwargs(args), **NO_TIERS}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        tiers = {"disk": {"kv_offload_disk_path": f"{work}/disk"}}
        if importlib.util.find_spec("redis") is None:
            print("the redis client package is not installed: the Redis tier is not measured")
        elif url := args.redis_url or stack.enter_context(local_redis(work)):
            tiers["redis"] = {"kv_offload_redis_url": url}
        else:
            print("no redis-server found and no --redis-url given: the Redis tier is not measured")
        for name, extra in tiers.items():
            results[name] = measure({**base, **extra}, prefix, questions, args.output_len)
    rows = [("tier", "cached after restart", "cached tokens", "TTFT s", "cold TTFT s", "output identical")]
    for name, r in results.items():
        rows.append((name, f"{r['cached_fraction']:.1%}", f"{r['cached_tokens']} / {r['prompt_tokens']}",
                     f"{r['ttft_s']:.4f}", f"{r['cold_ttft_s']:.4f}", str(r["identical"])))
    print_table(f"KV tiers after a restart: prefix {args.prefix_len} tokens, question {args.question_len}, "
                f"output {args.output_len}", rows)
    write_json(args.output_json, {"results": results, "prefix_len": args.prefix_len,
                                  "question_len": args.question_len, "model": args.model})
    return 0 if all(r["identical"] for r in results.values()) else 1


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("kv-restart", help="cached fraction of a known prefix after a restart "
                                                       "(disk and Redis KV tiers)")
    p.add_argument("--prefix-len", type=int, default=2000, help="the known prefix's tokens")
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--redis-url", default=None,
                   help="a Redis to use (default: start a redis-server on 127.0.0.1 when one is installed)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run)
