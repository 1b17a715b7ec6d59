"""Prompts and checks shared by the speculative-decoding tests."""
from __future__ import annotations

import random

from pagoda import LLM, SamplingParams

VOCAB = 512
PERIOD = 12  # the repeated unit of the copy prompts


def copy_prompts(n: int, seed: int, length: int = 40, shared: int = 0) -> list[dict]:
    """Prompts made of a random unit of PERIOD tokens repeated; the first ``shared`` tokens of
    every prompt are the same (a common prefix for the prefix cache)."""
    rng = random.Random(seed)
    common = [rng.randrange(16, VOCAB) for _ in range(shared)]
    out = []
    for i in range(n):
        unit = [rng.randrange(16, VOCAB) for _ in range(PERIOD)]
        out.append({"prompt_token_ids": common + (unit * length)[:length + i % 5]})
    return out


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 50) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(16, VOCAB) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def generate(llm: LLM, prompts: list[dict], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_no_leak(llm: LLM) -> None:
    """Every block is back: free, or cached and evictable (flushed here)."""
    core = llm.engine.core
    core.kv.check_invariants([])
    core.reset_prefix_cache()
    assert core.kv.num_used_blocks == 0
