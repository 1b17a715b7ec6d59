"""Sliding-window models against transformers on prompts and generations longer than the
window: Mistral (every layer windowed) and Qwen2 (only layers from max_window_layers on)."""
from __future__ import annotations

import json

from pagoda import LLM
from tests.models.parity_helpers import check_greedy, check_logprobs, greedy, hf_model

WINDOW = 16
PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 7], list(range(100, 190, 3)), list(range(200, 223))]


def test_mistral_window_matches_transformers(model_factory):
    model_dir = model_factory("mistral", sliding_window=WINDOW)
    assert json.loads((model_dir / "config.json").read_text())["sliding_window"] == WINDOW
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    check_logprobs(llm, hf, PROMPTS, max_tokens=20)
    full = check_greedy(llm, hf, PROMPTS, 20)
    # The same through chunked prefill (chunks start inside and past the window) and tiny blocks.
    chunked = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256, long_prefill_token_threshold=7,
                  block_size=4)
    assert greedy(chunked, PROMPTS, 20) == full


def test_qwen2_window_per_layer_matches_transformers(model_factory):
    model_dir = model_factory("qwen2", sliding_window=WINDOW, extra_config={"max_window_layers": 1})
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    assert llm.config.model.sliding_windows == (None, WINDOW)
    hf = hf_model(model_dir)
    check_logprobs(llm, hf, PROMPTS[:2], max_tokens=20)
    check_greedy(llm, hf, PROMPTS, 16)
