"""Async scheduling on and off, measured side by side (``--async-scheduling``).

``pagoda bench throughput --compare async-scheduling`` runs one workload through the engine
twice, one decode step per schedule both times (``num_scheduler_steps`` 1); ``decode_on_off``
is the decode-phase figure of ``pagoda bench gpu all``'s ``async-scheduling`` stage.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pagoda.bench import gpu

MODES = {"sync": False, "async": True}


def engine_modes(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``kwargs`` with async scheduling off, then on; one decode step per schedule in both."""
    return {name: {**kwargs, "async_scheduling": on, "num_scheduler_steps": 1} for name, on in MODES.items()}


def decode_on_off(model_dir: Path, batch: int, input_len: int, output_len: int, out: dict[str, Any],
                  seed: int = 0) -> None:
    """Decode tok/s of ``batch`` sequences of the model in ``model_dir`` (random weights) with
    async scheduling off and on, into ``out`` as each is measured (``sync``, ``async``, then
    ``ratio``)."""
    from pagoda import LLM

    rng = random.Random(seed)
    vocab = gpu._vocab_size(model_dir)
    prompts = [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(batch)]
    base = gpu.engine_kwargs(model_dir, input_len + output_len, False, 0.9, max_num_seqs=batch)
    for name, kwargs in engine_modes(base).items():
        llm = LLM(**kwargs)
        try:
            gpu.time_decode(llm, prompts, min(output_len, 16))  # warm-up
            seconds, tokens = gpu.time_decode(llm, prompts, output_len)
        finally:
            llm.shutdown()
        out[name] = {"decode_tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds * batch / tokens}
    out["ratio"] = out["async"]["decode_tokens_per_s"] / out["sync"]["decode_tokens_per_s"]
