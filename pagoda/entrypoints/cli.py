"""The ``pagoda`` command.

    pagoda serve [MODEL] [--port 8000] [engine options]   OpenAI-compatible server
    pagoda make-model --out DIR [...]                     random-weight test checkpoint
    pagoda train-demo --out DIR [...]                     train the built-in demo model
    pagoda run-batch -i IN.jsonl -o OUT.jsonl [...]       a Batch API file run offline
    pagoda env [--json]                                   CPU, kernel variant chosen and why
    pagoda top [--url URL] [--once]                       a running server's dashboard in the terminal
    pagoda bench NAME [...]                               benchmarks (serve, sweep, frontend, ...)

Every subcommand stores its handler as ``func`` on the parsed namespace; ``main`` calls it and
exits with what it returns.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import Any, Callable, Sequence

# ``pagoda bench`` subcommands: name -> "module:function", the function taking the bench
# subparsers (``add_parser`` on it, ``set_defaults(func=...)``). Modules are imported only
# when the command line is ``pagoda bench ...`` (or the whole parser is built): they bring
# torch and triton, which ``pagoda serve``'s HTTP process never needs. One that fails to import
# does not break the other commands.
# To add a benchmark, add a line here or call ``register_bench`` before ``main``.
BENCH_COMMANDS: dict[str, str | Callable[[Any], Any]] = {
    "serve": "pagoda.bench.serve:add_serve_cli",
    "sweep": "pagoda.bench.sweep:add_sweep_cli",
    "frontend": "pagoda.bench.frontend:add_frontend_cli",
    "throughput": "pagoda.bench.throughput:add_cli",
    "latency": "pagoda.bench.latency:add_cli",
    "host": "pagoda.bench.host:add_cli",
    "block-tables": "pagoda.bench.block_tables:add_cli",
    "quantization": "pagoda.bench.quantization:add_cli",
    "kv-cache-dtype": "pagoda.bench.kv_dtype:add_cli",
    "gemm": "pagoda.bench.gemm:add_cli",
    "moe": "pagoda.bench.moe:add_cli",
    "decode-blocks": "pagoda.bench.decode_blocks:add_cli",
    "kernel-variants": "pagoda.bench.kernel_variants:add_cli",
    "peers": "pagoda.bench.peers:add_cli",
    "prefix": "pagoda.bench.prefix:add_cli",
    "kv-tiers": "pagoda.bench.kv_tiers:add_cli",
    "kv-restart": "pagoda.bench.kv_restart:add_cli",
    "chunked": "pagoda.bench.chunked:add_cli",
    "gpu": "pagoda.bench.gpu_cli:add_cli",
    "spec": "pagoda.bench.spec:add_spec_cli",
    "stress": "pagoda.bench.stress_cli:add_cli",
    "fuzz": "pagoda.bench.fuzz:add_cli",
    "guidellm": "pagoda.bench.guidellm:add_cli",
    "router": "pagoda.bench.router:add_cli",
    "structured": "pagoda.bench.structured:add_cli",
    "lora": "pagoda.bench.lora:add_cli",
    "priority": "pagoda.bench.priority:add_cli",
    "batch": "pagoda.bench.batch:add_cli",
}


def register_bench(name: str, add_fn: str | Callable[[Any], Any]) -> None:
    """Add ``pagoda bench NAME``; ``add_fn`` is a function or a ``"module:function"`` path."""
    BENCH_COMMANDS[name] = add_fn


def _resolve(add_fn: str | Callable[[Any], Any]) -> Callable[[Any], Any]:
    if callable(add_fn):
        return add_fn
    module, _, function = add_fn.partition(":")
    return getattr(importlib.import_module(module), function)


def _add_bench_commands(subparsers: Any, load: bool = True) -> None:
    """``pagoda bench`` with every ``BENCH_COMMANDS`` entry, or (``load`` False) only its name in
    the command list."""
    bench = subparsers.add_parser("bench", help="benchmarks", description="pagoda benchmarks")
    if not load:
        return
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="NAME", required=True)
    for name, add_fn in BENCH_COMMANDS.items():
        try:
            _resolve(add_fn)(bench_sub)
        except Exception:  # a broken benchmark module must not take `pagoda serve` down with it
            _add_broken_bench(bench_sub, name, traceback.format_exc())


def _add_broken_bench(bench_sub: Any, name: str, error: str) -> None:
    def fail(args: argparse.Namespace) -> int:
        print(f"pagoda bench {name} is unavailable; loading it failed:\n{error}", file=sys.stderr)
        return 2

    parser = bench_sub.add_parser(name, help="(unavailable: failed to load)", add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    parser.set_defaults(func=fail)


def _add_serve_command(subparsers: Any) -> None:
    from pagoda.entrypoints.openai.server import add_serve_args
    from pagoda.models.registry import supported_summary

    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible API server",
                                  description="Serve MODEL through an OpenAI-compatible HTTP API.",
                                  epilog=supported_summary(), formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """``pagoda serve``: the single API server, several models behind one server (``--model``
    more than once, ``--models-config``), or replicas on Ray Serve when the flags ask for them
    (``--num-replicas N`` with N > 1, autoscaling, ``--ray-address``). The choice is made here
    so that no server imports another."""
    from pagoda.entrypoints.openai.models_config import several_models_on_ray_error, wants_several_models
    from pagoda.entrypoints.openai.server import prepare_serve, run_server
    from pagoda.entrypoints.ray.args import ray_flags, uses_ray

    code = prepare_serve(args)
    if code is not None:
        return code
    if wants_several_models(args):
        if uses_ray(args):
            print(f"pagoda serve: error: {several_models_on_ray_error(', '.join(ray_flags(args)))}", file=sys.stderr)
            return 1
        from pagoda.entrypoints.openai.models_server import run_models_server

        return run_models_server(args)
    if uses_ray(args):
        from pagoda.entrypoints.ray.server import run_ray_server

        return run_ray_server(args)
    return run_server(args)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``pagoda`` parser; given the command line ``argv``, the benchmarks' subcommands are
    loaded only when it may name one (``bench``, or no command yet)."""
    from pagoda.tools.make_model import add_cli as add_make_model

    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: an LLM inference serving engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve_command(subparsers)
    add_make_model(subparsers)
    from pagoda.tools.train_demo import add_cli as add_train_demo

    add_train_demo(subparsers)
    from pagoda.entrypoints.openai.batch.offline import add_cli as add_run_batch

    add_run_batch(subparsers)

    from pagoda.tools.env import add_cli as add_env

    add_env(subparsers)
    from pagoda.entrypoints.top import add_cli as add_top

    add_top(subparsers)
    command = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    _add_bench_commands(subparsers, load=argv is None or command in (None, "bench"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pagoda.bench.extras import MissingBenchExtra
    from pagoda.env_vars import interpret_triton_without_a_gpu
    from pagoda.omp import configure_openmp

    configure_openmp()  # before anything imports torch: its OpenMP runtime reads the settings once
    interpret_triton_without_a_gpu()  # before anything imports triton (building the parser does)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # a command line written for vllm serve works where it can
        from pagoda.entrypoints.vllm_flags import translate, unknown_flag_hint

        try:
            argv = ["serve", *translate(argv[1:])]
        except ValueError as exc:
            print(f"pagoda serve: error: {exc}", file=sys.stderr)
            return 2
        parser = build_parser(argv)
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            parser.error(unknown_flag_hint(f"unrecognized arguments: {' '.join(unknown)}"))
    else:
        args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MissingBenchExtra as exc:  # a benchmark's optional package: say how to install it
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


def console_main() -> None:
    """The ``pagoda`` program (the console script and ``python -m pagoda.entrypoints.cli``).
    A server that has stopped ends without the interpreter's teardown (its engine core is gone,
    its logs flushed): a second less of every restart. Other commands exit normally."""
    code = main()
    if sys.argv[1:2] == ["serve"]:
        from pagoda.process_exit import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
