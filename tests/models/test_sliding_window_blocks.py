"""A long generation on a small-window Mistral with prefix caching off holds a bounded number of
KV blocks (those behind the window are given back) and still matches transformers token for
token; with prefix caching on the same run keeps every block."""
from __future__ import annotations

from pagoda import LLM
from tests.models.parity_helpers import check_greedy, greedy, hf_model

WINDOW, BLOCK, CHUNK, STEPS = 16, 4, 8, 4
PROMPTS = [list(range(30, 70)), list(range(200, 223))]
NEW = 96


def _peak_blocks(llm: LLM) -> list[int]:
    """Records the pool's used blocks after every allocation."""
    kv, seen = llm.engine.core.kv, []
    allocate = kv.allocate

    def recording(*args, **kwargs):
        ok = allocate(*args, **kwargs)
        seen.append(kv.num_used_blocks)
        return ok

    kv.allocate = recording
    return seen


def test_window_release_bounds_blocks_and_matches_transformers(model_factory):
    model_dir = model_factory("mistral", sliding_window=WINDOW)
    common = dict(kv_cache_memory=8 << 20, max_model_len=256, block_size=BLOCK, long_prefill_token_threshold=CHUNK,
                  num_scheduler_steps=STEPS)
    llm = LLM(str(model_dir), enable_prefix_caching=False, **common)
    used = _peak_blocks(llm)
    got = check_greedy(llm, hf_model(model_dir), PROMPTS, NEW)
    # Per sequence: the window's blocks, the chunk being computed (or a round of STEPS decode steps)
    # and a partial block at each end.
    bound = len(PROMPTS) * (-(-(WINDOW + max(CHUNK, STEPS)) // BLOCK) + 1)
    assert max(used) <= bound, (max(used), bound)
    assert llm.engine.core.kv.num_used_blocks == 0
    llm.engine.core.kv.check_invariants([])
    # Without the release (prefix caching keeps every block) the blocks grow with the length.
    keep = LLM(str(model_dir), enable_prefix_caching=True, **common)
    kept = _peak_blocks(keep)
    assert greedy(keep, PROMPTS, NEW) == got
    assert max(kept) >= sum(-(-(len(p) + NEW - 1) // BLOCK) for p in PROMPTS) > 3 * bound
