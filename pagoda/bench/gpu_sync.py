"""Where decode steps wait for the device (``pagoda bench gpu all``'s ``sync-watch`` stage).

Under async scheduling the host should never wait for the step in flight except where it reads
the previous step's ids. torch's CUDA sync debug mode warns at every synchronizing call (a
blocking copy, ``.item()``, ``.tolist()`` of a device tensor, indexing with a host list, a
stream sync); ``watch_syncs`` records each with the innermost pagoda frames of the Python stack
that made it, so a GPU run names every line that makes the host wait. Without CUDA it only runs
the function (the dry run walks through the stage).
"""
from __future__ import annotations

import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

_PACKAGE = str(Path(__file__).resolve().parents[1])


def _site() -> str:
    """The innermost pagoda frame below this module: where the synchronizing call was made."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(_PACKAGE) and not frame.filename.endswith(("gpu_sync.py", "warnings.py")):
            return f"{Path(frame.filename).relative_to(Path(_PACKAGE).parent)}:{frame.lineno} {frame.name}"
    return "outside pagoda"


def watch_syncs(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``fn()``'s result and its synchronizing calls: ``count`` and ``sites`` (call site ->
    count, most frequent first); ``watched`` False where the device has no sync debug mode."""
    if not torch.cuda.is_available():
        return fn(), {"watched": False, "count": 0, "sites": {}}
    sites: Counter[str] = Counter()
    lock = threading.Lock()
    previous_mode = torch.cuda.get_sync_debug_mode()
    previous_show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if "synchronizing" in str(message):
            with lock:
                sites[_site()] += 1
        else:
            previous_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            warnings.showwarning = previous_show
    return result, {"watched": True, "count": sum(sites.values()), "sites": dict(sites.most_common())}


def measure_decode_syncs(model_dir: Path, batch: int, input_len: int, tokens: int, seed: int = 0) -> dict[str, Any]:
    """Greedy decode of ``batch`` random prompts for ``tokens`` tokens with async scheduling (and
    CUDA graphs where there are any), watched: synchronizing calls a step and their sites."""
    import random

    from pagoda import LLM, SamplingParams
    from pagoda.bench import gpu

    rng = random.Random(seed)
    vocab = gpu._vocab_size(model_dir)
    prompts = [{"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(input_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm = LLM(**gpu.engine_kwargs(model_dir, input_len + tokens + 1, False, 0.5, max_num_seqs=batch,
                                  async_scheduling=True))
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
                     use_tqdm=False)  # warm-up: graphs, kernel choices
        outs, watched = watch_syncs(lambda: llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.shutdown()
    steps = tokens  # one prefill step, then a decode step for each token after the first
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"batch": batch, "tokens": tokens, "output_tokens": made, **watched,
            "syncs_per_step": watched["count"] / steps}


def summary(results: dict[str, Any]) -> str:
    if "syncs_per_step" not in results:
        return ""
    if not results["watched"]:
        return f"{results['output_tokens']} tokens decoded; no CUDA sync debug mode here (CPU)"
    top = "; ".join(f"{site} x{n}" for site, n in list(results["sites"].items())[:4])
    return (f"{results['syncs_per_step']:.2f} synchronizing calls a step (batch {results['batch']}, "
            f"{results['tokens']} tokens, async scheduling): {top or 'none'}")
