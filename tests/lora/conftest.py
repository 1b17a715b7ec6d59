"""Fixtures of the LoRA tests: reference generations and one LoRA-enabled engine."""
from __future__ import annotations

import pytest
from lora_helpers import hf_generate


@pytest.fixture(scope="session")
def hf_outputs(llama_dir, lora_adapters) -> dict[str | None, list[list[int]]]:
    """name (None: the base model) -> the reference generation of each prompt."""
    refs: dict[str | None, list[list[int]]] = {None: hf_generate(llama_dir, None)}
    for name, path in lora_adapters.items():
        refs[name] = hf_generate(llama_dir, path)
    return refs


@pytest.fixture(scope="session")
def lora_llm(llama_dir):
    """A LoRA engine with a slot for every test adapter plus one."""
    from pagoda import LLM

    llm = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=512, enable_lora=True, max_loras=4,
              max_lora_rank=16)
    yield llm
    llm.shutdown()
