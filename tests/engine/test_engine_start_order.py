"""The server's engine core is spawned before the front end resolves its config (which imports
torch) and loads its tokenizers, so the model loads meanwhile (``AsyncEngine.__init__``); a front
end that fails after the spawn stops the engine core it started and leaves no socket folder."""
from __future__ import annotations

import asyncio
import os

import pytest

from pagoda.config import EngineArgs
from pagoda.engine import async_engine
from pagoda.engine.core_client import EngineCoreClient


def test_the_engine_core_is_running_before_the_config_and_the_tokenizer(monkeypatch):
    clients: list[EngineCoreClient] = []
    alive_at_tokenizer: list[list[EngineCoreClient]] = []
    alive_at_config: list[list[EngineCoreClient]] = []
    load, real_launch = async_engine.load_tokenizer, EngineCoreClient.launch
    real_config = async_engine.EngineConfig.from_args

    def watched(path):
        alive_at_tokenizer.append([c for c in clients if c.is_alive()])
        return load(path)

    def config(args):
        alive_at_config.append([c for c in clients if c.is_alive()])
        return real_config(args)

    def launch(self):
        clients.append(self)
        real_launch(self)

    monkeypatch.setattr(EngineCoreClient, "launch", launch)
    monkeypatch.setattr(async_engine, "load_tokenizer", watched)
    monkeypatch.setattr(async_engine.EngineConfig, "from_args", staticmethod(config))

    async def run() -> int:
        engine = async_engine.AsyncEngine(EngineArgs(kv_cache_memory=8 << 20))
        try:
            ready = await engine.start()
            return ready.pid
        finally:
            await engine.shutdown()

    pid = asyncio.run(run())
    assert alive_at_tokenizer and all(len(a) == 1 and a[0].pid == pid for a in alive_at_tokenizer)
    assert [[c.pid for c in a] for a in alive_at_config] == [[pid]]


def test_a_missing_model_is_refused_before_anything_is_spawned(monkeypatch, tmp_path):
    launched: list[EngineCoreClient] = []
    monkeypatch.setattr(EngineCoreClient, "launch", lambda self: launched.append(self))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        async_engine.AsyncEngine(EngineArgs(model=str(tmp_path / "nowhere")))
    assert launched == []


def test_a_front_end_failure_after_the_spawn_stops_the_engine_core(monkeypatch):
    clients: list[EngineCoreClient] = []
    real_launch = EngineCoreClient.launch

    def launch(self):
        clients.append(self)
        real_launch(self)

    def broken(path):
        raise OSError("no tokenizer here")

    monkeypatch.setattr(EngineCoreClient, "launch", launch)
    monkeypatch.setattr(async_engine, "load_tokenizer", broken)

    async def build() -> None:
        async_engine.AsyncEngine(EngineArgs(kv_cache_memory=8 << 20))

    with pytest.raises(OSError, match="no tokenizer here"):
        asyncio.run(build())
    (client,) = clients
    assert client.process is not None and not client.process.is_alive()
    assert not os.path.exists(client.ipc_dir)
