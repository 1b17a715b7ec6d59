"""Fixtures of the server tests: one plain ``pagoda serve`` shared by the modules that only send it
requests (each server start costs seconds of the suite's budget)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from server_helpers import ServerProcess, start_server

TINY = "tiny"  # the served name of the shared server's model (the llama test checkpoint, float32)
THINK = "m"  # the served name of the shared thinking server's model


@pytest.fixture(scope="session")
def tiny_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``pagoda serve`` on the llama checkpoint with default options, served as ``tiny``. Users
    must leave it as they found it: no engine kills, no server options of their own (a module
    that needs those starts its own server)."""
    srv = start_server(llama_dir, tmp_path_factory.mktemp("tiny-server-logs"), "--served-model-name", TINY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def think_server(think_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``pagoda serve`` on the scripted thinking checkpoint (``think_model``) with
    ``--reasoning-parser deepseek_r1``, served as ``m``, for the modules that only send it
    requests. Started here but not waited for: the first module to use it waits for it beside
    its own servers (``side_by_side(..., shared=(think_server,))``), so their start-ups overlap."""
    srv = ServerProcess(think_model.path, tmp_path_factory.mktemp("think-server-logs"), "--served-model-name", THINK,
                        "--reasoning-parser", "deepseek_r1")
    yield srv
    srv.stop()
