"""Fixtures of the server tests: one plain ``pagoda serve`` shared by the modules that only send it
requests (each server start costs seconds of the suite's budget)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from server_helpers import ServerProcess, start_server

TINY = "tiny"  # the served name of the shared server's model (the llama test checkpoint, float32)


@pytest.fixture(scope="session")
def tiny_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``pagoda serve`` on the llama checkpoint with default options, served as ``tiny``. Users
    must leave it as they found it: no engine kills, no server options of their own (a module
    that needs those starts its own server)."""
    srv = start_server(llama_dir, tmp_path_factory.mktemp("tiny-server-logs"), "--served-model-name", TINY)
    yield srv
    srv.stop()
