"""Fixtures of the family-parametrised vision-language tests (test_qwen_vl.py, test_llava.py):
a module defines ``family`` (its checkpoints' architectures); these build the random-weight
checkpoint, the transformers reference on it and a float32 engine, once per family."""
from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.tools.make_vlm import make_vlm
from vlm_helpers import load_reference


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return make_vlm(tmp_path_factory.mktemp(family), arch=family)


@pytest.fixture(scope="module")
def ref(checkpoint, family):
    return load_reference(checkpoint, family)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(str(checkpoint), dtype="float32", kv_cache_memory=32 << 20)
    yield engine
    engine.shutdown()
