"""``pagoda bench router``: routing policies of the Ray Serve deployment side by side, in one run.

A multi-tenant shared-prefix workload (``--num-tenants`` system prompts of ``--prefix-len``
tokens, ``--questions`` short questions each, arriving interleaved: round after round, every
tenant asks once, in a shuffled order) goes through the same endpoint, ``pagoda serve MODEL
--num-replicas N --routing P``, once per policy. Per policy: the prefix-cache hit rate (the
replicas' own ``pagoda:prefix_cache_hits``/``queries`` counters), throughput, and TTFT p50/p99.
Each replica's KV cache holds ``--cache-prefixes`` tenants' prefixes, fewer than all of them,
so where requests land decides what can hit. Then the Ray path's own cost: one replica through
Ray (``pagoda serve MODEL --ray-address local``: a Ray instance of its own, default routing)
against plain ``pagoda serve`` on the same workload, both up at once and taking turns
(``--overhead-repeats``, a fresh workload seed per turn so each starts with a cold cache).
Besides throughput it reports the CPU seconds per request of each endpoint's whole process
tree, by process, and what each burns idle: figures that other load on a shared machine
changes far less than throughput.

Everything runs inside a private network namespace (``pagoda.tools.netns``): Ray listens only
there. In the policy runs replicas are pinned one per CPU (``--pin-replicas-to-cpus``); in the
cost comparison neither the single server nor the one-replica Ray deployment is pinned (pinning
the whole Ray instance to one CPU would charge Ray's control plane to the engine's core, pinning
only the replica would give Ray a free core).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagoda.bench.common import FIRST_ORDINARY_ID, print_table, write_json
from pagoda.bench.extras import lazy_import

# bench extra, imported on first use (pagoda.bench.extras)
httpx = lazy_import("httpx")

PORT = 8000  # inside the private namespace nothing else listens
SINGLE_PORT = 8001  # the plain pagoda serve of the cost comparison, up beside the Ray one
STARTUP_TIMEOUT_S = 600.0
INNER_ENV = "PAGODA_BENCH_ROUTER_INNER"
IDLE_WINDOW_S = 10.0  # cost comparison: seconds both endpoints sit idle while their CPU use is read


def add_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("router", help="Ray Serve routing policies side by side on a shared-prefix "
                                    "workload; the Ray path's cost against one server",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model directory (default: a small random-weight Llama with 2048 positions, built once)")
    p.add_argument("--num-replicas", type=int, default=2)
    p.add_argument("--policies", default="round_robin,prefix_affinity", help="comma-separated routing policies")
    p.add_argument("--num-tenants", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens of each tenant's system prompt")
    p.add_argument("--questions", type=int, default=6, help="questions per tenant")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--cache-prefixes", type=float, default=9.0,
                   help="each replica's KV cache holds this many tenants' prefixes")
    p.add_argument("--skip-overhead", action="store_true", help="no one-replica Ray vs pagoda serve comparison")
    p.add_argument("--overhead-repeats", type=int, default=3,
                   help="cost comparison: both endpoints stay up and take turns this many times (a fresh "
                        "workload seed each turn); medians are compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)
    return p


# ---- the workload ------------------------------------------------------------------------------

def workload(args: argparse.Namespace, vocab: int, seed: int | None = None) -> list[list[int]]:
    rng = random.Random(args.seed if seed is None else seed)
    draw = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [draw(args.prefix_len) for _ in range(args.num_tenants)]
    prompts = []
    for _ in range(args.questions):
        order = list(range(args.num_tenants))
        rng.shuffle(order)
        prompts += [prefixes[t] + draw(args.question_len) for t in order]
    return prompts


def kv_cache_bytes(model: str, tokens: int) -> int:
    from pagoda.config import EngineArgs, EngineConfig

    config = EngineConfig.from_args(EngineArgs(model=model))
    m = config.model
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype.itemsize
    return per_token * tokens


# ---- one server --------------------------------------------------------------------------------

class Endpoint:
    def __init__(self, model: str, extra: list[str], log: Path, port: int = PORT) -> None:
        self.port = port
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", model, "--port", str(port),
               "--served-model-name", "bench", "--disable-log-stats", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, replicas: int | None) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                r = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10)
                if r.status_code == 200 and (replicas is None or
                                             sum(x["healthy"] for x in r.json()["replicas"]) == replicas):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def cache_counters(port: int = PORT) -> tuple[float, float]:
    """(hits, queries) summed over the replicas' prefix-cache counters."""
    import re

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("pagoda:prefix_cache_hits_total"), total("pagoda:prefix_cache_queries_total")


async def drive(prompts: list[list[int]], output_len: int, concurrency: int, port: int = PORT) -> dict[str, float]:
    import json

    ttfts: list[float] = []
    queue = list(enumerate(prompts))
    queue.reverse()
    errors = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while queue:
            _, prompt = queue.pop()
            body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            start = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    errors += 1
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        if "error" in json.loads(line[6:]):
                            errors += 1
                            break
                        first = time.perf_counter() - start
            if first is not None:
                ttfts.append(first)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{errors} requests failed")
    ttfts.sort()
    return {"elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def process_kind(proc: Any) -> str:
    """A short name for one process of an endpoint's tree (for the CPU breakdown)."""
    try:
        cmdline = proc.cmdline()
    except Exception:  # noqa: BLE001 - psutil.Error: it went away
        return "?"
    title = cmdline[0] if cmdline else proc.name()
    if title.startswith("ray::"):  # a Ray worker's process title: ray::ServeReplica:app:Deployment
        return title.split()[0].replace("ServeReplica:pagoda:", "")
    text = " ".join(cmdline)
    if "multiprocessing" in text and "spawn" in text:
        return "engine core"
    if "pagoda.entrypoints.cli" in text:
        return "pagoda serve"
    script = next((os.path.basename(a) for a in cmdline[1:] if a.endswith(".py")), None)
    return script or (os.path.basename(title).split()[0] if title else proc.name())


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the process ``pid`` and its descendants,
    by kind of process. A measure of cost that other load on the machine does not change."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        kind = process_kind(proc)
        out[kind] = out.get(kind, 0.0) + times.user + times.system
    return out


def timed_run(prompts: list[list[int]], args: argparse.Namespace, port: int,
              pid: int | None = None) -> dict[str, Any]:
    hits0, queries0 = cache_counters(port)
    cpu0 = tree_cpu(pid) if pid is not None else {}
    result: dict[str, Any] = dict(asyncio.run(drive(prompts, args.output_len, args.concurrency, port)))
    if pid is not None:
        cpu = tree_cpu(pid)
        result["cpu_s_by_process"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu.items()}
        result["cpu_ms_per_request"] = 1e3 * sum(result["cpu_s_by_process"].values()) / len(prompts)
        result["requests"] = len(prompts)
    hits, queries = cache_counters(port)
    result["hit_rate"] = (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
    return result


def warm_up(replicas: int, port: int) -> None:
    """One request per replica on a prompt no tenant shares."""
    asyncio.run(drive([[FIRST_ORDINARY_ID + 1] * 32] * replicas * 2, 2, replicas, port))


def measure(model: str, extra: list[str], prompts: list[list[int]], args: argparse.Namespace, log: Path,
            replicas: int) -> dict[str, float]:
    endpoint = Endpoint(model, extra, log)
    try:
        endpoint.wait_ready(replicas)
        warm_up(replicas, PORT)
        return timed_run(prompts, args, PORT)
    finally:
        endpoint.stop()


def measure_overhead(model: str, engine: list[str], args: argparse.Namespace, vocab: int,
                     logs: Path) -> dict[str, Any]:
    """Plain pagoda serve and a one-replica Ray deployment, both up, taking turns."""
    single = Endpoint(model, engine, logs / "single.log", SINGLE_PORT)
    ray_one = Endpoint(model, [*engine, "--ray-address", "local"], logs / "ray-1.log")  # default routing
    runs: dict[str, list[dict[str, float]]] = {"pagoda_serve": [], "ray_one_replica": []}
    try:
        single.wait_ready(None)
        ray_one.wait_ready(1)
        warm_up(1, SINGLE_PORT)
        warm_up(1, PORT)
        # What each endpoint burns with no request at all (Ray's control plane, metrics...),
        # both measured over the same seconds.
        before = {name: tree_cpu(e.proc.pid) for name, e in (("pagoda_serve", single), ("ray_one_replica", ray_one))}
        start = time.perf_counter()
        time.sleep(IDLE_WINDOW_S)
        idle_s = time.perf_counter() - start
        idle = {name: 1e3 * (sum(tree_cpu(e.proc.pid).values()) - sum(before[name].values())) / idle_s
                for name, e in (("pagoda_serve", single), ("ray_one_replica", ray_one))}
        for turn in range(args.overhead_repeats):
            prompts = workload(args, vocab, seed=args.seed + 1 + turn)  # fresh prefixes: a cold cache each turn
            order = [("pagoda_serve", SINGLE_PORT, single), ("ray_one_replica", PORT, ray_one)]
            for name, port, endpoint in (order if turn % 2 == 0 else order[::-1]):
                runs[name].append(timed_run(prompts, args, port, endpoint.proc.pid))
    finally:
        single.stop()
        ray_one.stop()
    medians = {name: statistics.median(r["requests_per_s"] for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r["cpu_ms_per_request"] for r in rs) for name, rs in runs.items()}
    # Per request net of the idle burn (what the request path itself costs).
    net = {name: statistics.median(r["cpu_ms_per_request"] - idle[name] * r["elapsed_s"] / r["requests"]
                                   for r in rs) for name, rs in runs.items()}
    return {"runs": runs, "median_requests_per_s": medians, "median_cpu_ms_per_request": cpu,
            "idle_cpu_ms_per_s": idle, "median_request_path_cpu_ms_per_request": net,
            "throughput_ratio": medians["ray_one_replica"] / medians["pagoda_serve"],
            "cpu_ratio": cpu["ray_one_replica"] / cpu["pagoda_serve"]}


# ---- the command -------------------------------------------------------------------------------

def default_model(cache: Path) -> str:
    from pagoda.tools.make_model import make_model

    path = cache / "bench-router-llama-2k"
    if not (path / "config.json").exists():
        make_model(path, arch="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                   vocab_size=2048, max_position_embeddings=2048)
    return str(path)


def run(args: argparse.Namespace) -> int:
    if os.environ.get(INNER_ENV) != "1":  # go into a private network namespace first
        from pagoda.tools.netns import netns_command

        env = {**os.environ, INNER_ENV: "1"}
        return subprocess.call(netns_command([sys.executable, "-m", "pagoda.entrypoints.cli", *sys.argv[1:]]),
                               env=env)
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.tools.make_model import cache_dir

    model = args.model or default_model(cache_dir())
    vocab = EngineConfig.from_args(EngineArgs(model=model)).model.vocab_size
    prompts = workload(args, vocab)
    block = 16
    per_prefix = -(-(args.prefix_len + args.question_len + args.output_len) // block) * block
    cache = kv_cache_bytes(model, int(args.cache_prefixes * per_prefix))
    engine = ["--kv-cache-memory", str(cache), "--max-model-len", str(per_prefix + block)]
    logs = Path(tempfile.mkdtemp(prefix="pagoda-bench-router-"))
    print(f"model {model}; {len(prompts)} requests: {args.num_tenants} tenants x {args.questions} questions, "
          f"prefix {args.prefix_len} + question {args.question_len} tokens, {args.output_len} out; "
          f"KV cache per replica {cache / 2**20:.1f} MiB ({args.cache_prefixes:g} prefixes); logs in {logs}")

    results: dict[str, Any] = {"policies": {}, "config": {k: v for k, v in vars(args).items() if k != "func"}}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        extra = [*engine, "--num-replicas", str(args.num_replicas), "--routing", policy, "--pin-replicas-to-cpus",
                 "--replica-num-cpus", "1"]
        print(f"-- {policy} ...", flush=True)
        results["policies"][policy] = measure(model, extra, prompts, args, logs / f"{policy}.log", args.num_replicas)
    rows = [("policy", "hit rate", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms")]
    for policy, r in results["policies"].items():
        rows.append((policy, f"{r['hit_rate']:.1%}", f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                     f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p99_s'] * 1e3:.0f}"))
    if len(rows) > 1:
        print_table(f"routing, {args.num_replicas} replicas", rows)
    p = results["policies"]
    if "round_robin" in p and "prefix_affinity" in p:
        rr, pa = p["round_robin"], p["prefix_affinity"]
        results["ratios"] = {"hit_rate": pa["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
                             "throughput": pa["requests_per_s"] / rr["requests_per_s"]}
        print(f"prefix_affinity / round_robin: hit rate x{results['ratios']['hit_rate']:.2f} (bar >= 2), "
              f"throughput x{results['ratios']['throughput']:.2f} (bar >= 1.5)")

    if not args.skip_overhead:
        print("-- one replica through Ray vs pagoda serve ...", flush=True)
        overhead = measure_overhead(model, engine, args, vocab, logs)
        results["overhead"] = overhead
        runs = overhead["runs"]
        print_table(f"Ray path cost (1 replica vs pagoda serve, neither pinned, {args.overhead_repeats} turns each)", [
            ("endpoint", "req/s per turn", "median req/s", "median TTFT p50 ms"),
            *((name, " ".join(f"{r['requests_per_s']:.2f}" for r in runs[name]),
               f"{overhead['median_requests_per_s'][name]:.2f}",
               f"{statistics.median(r['ttft_p50_s'] for r in runs[name]) * 1e3:.0f}") for name in runs)])
        kinds = sorted({k for rs in runs.values() for r in rs for k in r["cpu_s_by_process"]})
        n = len(prompts)
        print_table("CPU ms per request by process (median over turns; all processes of each endpoint)", [
            ("process", *runs),
            *((kind, *(f"{statistics.median(1e3 * r['cpu_s_by_process'].get(kind, 0.0) / n for r in runs[name]):.1f}"
                       for name in runs)) for kind in kinds),
            ("total", *(f"{overhead['median_cpu_ms_per_request'][name]:.1f}" for name in runs)),
            ("idle burn, ms/s", *(f"{overhead['idle_cpu_ms_per_s'][name]:.1f}" for name in runs)),
            ("total less idle burn", *(f"{overhead['median_request_path_cpu_ms_per_request'][name]:.1f}"
                                       for name in runs))])
        print(f"Ray / pagoda serve CPU per request (medians): x{overhead['cpu_ratio']:.3f} "
              "(what the Ray path adds; other load on the machine does not change it)")
        print(f"Ray / pagoda serve throughput (medians): x{overhead['throughput_ratio']:.3f} (bar >= 0.90)")
    write_json(args.output, results)
    return 0
