"""Every tensor-parallel test must leave no worker process behind."""
from __future__ import annotations

from typing import Iterator

import pytest
from tp_helpers import child_pids, wait_gone


@pytest.fixture(autouse=True)
def no_stray_workers() -> Iterator[None]:
    """Every test must leave no worker process behind."""
    before = child_pids()
    yield
    stray = wait_gone(child_pids() - before, 10.0)
    assert not stray, f"processes left running: {sorted(stray)}"
