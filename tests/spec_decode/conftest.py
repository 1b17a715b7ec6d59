"""Models for the speculative-decoding tests: a copy model (its greedy output repeats its prompt,
so drafts are accepted) and random models (drafts mostly rejected)."""
from __future__ import annotations

from pathlib import Path

import pytest
from spec_helpers import VOCAB


@pytest.fixture(scope="session")
def copy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagoda.bench.spec import make_copy_model

    return make_copy_model(tmp_path_factory.mktemp("copy"), hidden_size=192, num_layers=2, num_heads=2,
                           vocab_size=VOCAB, seed=3)
