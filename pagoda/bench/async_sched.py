"""Async scheduling on and off, measured side by side (``--async-scheduling``).

``pagoda bench throughput --compare async-scheduling`` runs one workload through two engines,
async scheduling off and on, one decode step per schedule in both (``num_scheduler_steps`` 1),
alternating ``--rounds`` times (``compare_throughput``: the median run of each counts, so
that load from other processes on a shared machine hits both alike). ``engine_modes`` also
serves the ``async-scheduling`` stage of ``pagoda bench gpu all`` (``gpu_stages.decode_on_off``).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

MODES = {"sync": False, "async": True}


def engine_modes(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``kwargs`` with async scheduling off, then on; one decode step per schedule in both."""
    return {name: {**kwargs, "async_scheduling": on, "num_scheduler_steps": 1} for name, on in MODES.items()}


def compare_throughput(kwargs: dict[str, Any], work: Any, repeats: int) -> dict[str, dict[str, Any]]:
    """Output tok/s of ``work`` (greedy, fixed output lengths) with async scheduling off and on:
    both engines loaded and warmed up, then ``repeats`` alternating runs; per mode the run of
    median time, and every run's seconds."""
    from pagoda import LLM, SamplingParams

    llms = {name: LLM(**kw) for name, kw in engine_modes(kwargs).items()}
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    try:
        for llm in llms.values():
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        for _ in range(repeats):
            for name, llm in llms.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - start)
                assert sum(len(o.outputs[0].token_ids) for o in outs) == work.num_output_tokens
    finally:
        for llm in llms.values():
            llm.shutdown()
    results = {}
    for name, runs in seconds.items():
        elapsed = statistics.median(runs)
        results[name] = {"elapsed_s": elapsed, "runs_s": runs, "requests_per_s": len(work.prompts) / elapsed,
                         "output_tokens_per_s": work.num_output_tokens / elapsed,
                         "total_tokens_per_s": (work.num_output_tokens + work.num_prompt_tokens) / elapsed}
    return results
