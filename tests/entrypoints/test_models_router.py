"""The several-models registry without engines: loads on demand, LRU unloads within the limits,
never unloading a busy model, waiting loads, failed loads and crashed engines; and the parsing of
``--model`` / ``--models-config``."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from pagoda.entrypoints.openai.models_config import (ModelSpec, fold_single_model, model_specs, read_models_file,
                                                     split_name, wants_several_models)
from pagoda.entrypoints.openai.models_router import (LOADABLE, LOADED, LOADING, LoadedModel, ModelRegistry,
                                                     ModelSlot, model_of)
from pagoda.entrypoints.openai.serving_common import APIError


class FakeEngine:
    """What the registry reads of an ``AsyncEngine``."""

    def __init__(self, pid: int) -> None:
        self.engine_pid = pid
        self.dead_reason: str | None = None
        self.output_processor = SimpleNamespace(requests={})
        self.callbacks: list[Callable[[str], None]] = []

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def on_dead(self, callback: Callable[[str], None]) -> None:
        self.callbacks.append(callback)

    def die(self, reason: str) -> None:
        self.dead_reason = reason
        for callback in self.callbacks:
            callback(reason)


class Starter:
    """A ``start`` function recording what it started and closed; ``gate`` holds a load."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.closed: list[str] = []
        self.fail: set[str] = set()
        self.gate: asyncio.Event | None = None

    async def __call__(self, slot: ModelSlot) -> LoadedModel:
        if self.gate is not None:
            await self.gate.wait()
        if slot.name in self.fail:
            raise ValueError(f"cannot load {slot.name}")
        self.started.append(slot.name)
        engine = FakeEngine(len(self.started))

        async def close() -> None:
            self.closed.append(slot.name)

        return LoadedModel(engine, app=None, close=close)  # type: ignore[arg-type]


def registry(starter: Starter, names: str = "abc", footprint: int = 10, **limits) -> ModelRegistry:
    specs = [ModelSpec(n, argparse.Namespace(model=f"/m/{n}"), footprint=footprint) for n in names]
    return ModelRegistry(specs, starter, adapters={"a-lora": "a"}, **limits)


def loaded(reg: ModelRegistry) -> list[str]:
    return sorted(s.name for s in reg.slots.values() if s.loaded is not None)


def test_loads_on_demand_and_unloads_the_least_recently_used_idle_model():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, max_loaded=2)
        for name in "ab":
            await reg.release(await reg.acquire(name))
        await reg.release(await reg.acquire("a"))  # b is now the least recently used
        slot = await reg.acquire("c")
        assert loaded(reg) == ["a", "c"] and starter.closed == ["b"]
        assert reg.slots["b"].status == LOADABLE and slot.status == LOADED
        await reg.release(slot)
        await reg.close()
        assert sorted(starter.closed) == ["a", "b", "c"]

    asyncio.run(run())


def test_memory_budget_counts_footprints():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, footprint=10, memory_budget=25)  # room for two
        for name in "abc":
            await reg.release(await reg.acquire(name))
        assert loaded(reg) == ["b", "c"] and starter.closed == ["a"]
        await reg.close()

    asyncio.run(run())


def test_a_busy_model_is_never_unloaded_the_new_one_waits_for_it():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, max_loaded=1)
        held = await reg.acquire("a")
        waiter = asyncio.create_task(reg.acquire("b"))
        for _ in range(20):  # let the load run as far as it can: it must wait for room
            await asyncio.sleep(0)
        assert not waiter.done() and reg.slots["b"].status == LOADING
        assert loaded(reg) == ["a"] and starter.closed == []
        await reg.release(held)
        b = await waiter
        assert loaded(reg) == ["b"] and starter.closed == ["a"] and b.in_flight == 1
        await reg.release(b)
        await reg.close()

    asyncio.run(run())


def test_an_operator_unload_refuses_a_busy_model():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter)
        a = await reg.acquire("a")
        with pytest.raises(APIError) as info:
            await reg.unload_idle("a")
        assert info.value.status == 409 and loaded(reg) == ["a"]
        await reg.release(a)
        assert (await reg.unload_idle("a-lora")).status == LOADABLE and starter.closed == ["a"]
        await reg.close()

    asyncio.run(run())


def test_engine_requests_outliving_their_http_request_keep_a_model_busy():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, max_loaded=1)
        a = await reg.acquire("a")
        await reg.release(a)
        a.loaded.engine.output_processor.requests["bg-0"] = object()  # a background response still running
        waiter = asyncio.create_task(reg.acquire("b"))
        await asyncio.sleep(0.05)
        assert not waiter.done() and loaded(reg) == ["a"]
        a.loaded.engine.output_processor.requests.clear()
        await reg.release(await waiter)  # the registry polls for the engine's requests to end
        assert loaded(reg) == ["b"]
        await reg.close()

    asyncio.run(run())


def test_requests_for_a_loading_model_wait_for_one_load():
    async def run() -> None:
        starter = Starter()
        starter.gate = asyncio.Event()
        reg = registry(starter)
        waiters = [asyncio.create_task(reg.acquire("a")) for _ in range(3)]
        await asyncio.sleep(0)
        assert reg.slots["a"].status == LOADING and not any(w.done() for w in waiters)
        starter.gate.set()
        slots = await asyncio.gather(*waiters)
        assert starter.started == ["a"] and slots[0].in_flight == 3
        await reg.close()

    asyncio.run(run())


def test_a_model_just_loaded_for_a_waiting_request_is_not_unloaded_before_it_runs():
    async def run() -> None:
        starter = Starter()
        starter.gate = asyncio.Event()
        reg = registry(starter, max_loaded=1)
        for_a = asyncio.create_task(reg.acquire("a"))
        await asyncio.sleep(0)
        for_b = asyncio.create_task(reg.acquire("b"))  # its load queues behind a's
        await asyncio.sleep(0)
        starter.gate.set()
        a = await for_a
        assert a.loaded is not None and loaded(reg) == ["a"] and not for_b.done()
        await reg.release(a)
        await reg.release(await for_b)
        assert loaded(reg) == ["b"] and starter.closed == ["a"]
        await reg.close()

    asyncio.run(run())


def test_a_load_that_outlasts_the_timeout_is_a_503_and_goes_on():
    async def run() -> None:
        starter = Starter()
        starter.gate = asyncio.Event()
        reg = registry(starter, load_timeout=0.01)
        with pytest.raises(APIError) as info:
            await reg.acquire("a")
        assert info.value.status == 503 and info.value.code == "model_loading"
        assert info.value.headers and "Retry-After" in info.value.headers
        starter.gate.set()
        await reg.slots["a"].task
        assert reg.slots["a"].status == LOADED
        await reg.close()

    asyncio.run(run())


def test_a_failed_load_is_a_503_naming_the_model_and_is_tried_again():
    async def run() -> None:
        starter = Starter()
        starter.fail.add("a")
        reg = registry(starter)
        with pytest.raises(APIError) as info:
            await reg.acquire("a")
        assert info.value.status == 503 and "'a'" in info.value.message and "cannot load a" in info.value.message
        assert reg.slots["a"].status == LOADABLE and "cannot load" in reg.slots["a"].last_error
        starter.fail.clear()
        await reg.release(await reg.acquire("a"))
        assert loaded(reg) == ["a"]
        await reg.close()

    asyncio.run(run())


def test_a_crashed_engine_frees_its_place_and_loads_again():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, max_loaded=2)
        a = await reg.acquire("a")
        await reg.release(await reg.acquire("b"))
        first = a.loaded.engine
        first.die("model 'a': the engine core process exited unexpectedly")
        assert a.status == LOADABLE and a.loaded is None and "exited" in a.last_error
        assert reg.slots["b"].status == LOADED  # the other model is untouched
        await reg.release(a)
        again = await reg.acquire("a")
        assert again.loaded.engine is not first and starter.started == ["a", "b", "a"]
        assert "a" in starter.closed  # what was left of the dead engine was closed
        await reg.release(again)
        await reg.close()

    asyncio.run(run())


def test_lookup_names_adapters_and_refuses_unknown_or_missing_models():
    reg = registry(Starter())
    assert reg.lookup("a-lora").name == "a"
    with pytest.raises(APIError) as info:
        reg.lookup("zzz")
    assert info.value.status == 404 and info.value.code == "model_not_found" and "'a'" in info.value.message
    for missing in (None, ""):
        with pytest.raises(APIError) as info:
            reg.lookup(missing)
        assert info.value.status == 400 and info.value.param == "model"
    with pytest.raises(APIError):
        reg.lookup(3)


def test_budget_checks_refuse_what_could_never_load():
    with pytest.raises(ValueError, match="more than --models-memory-budget"):
        registry(Starter(), footprint=100, memory_budget=50).check_budget()
    reg = registry(Starter(), max_loaded=1)
    for slot in reg.slots.values():
        slot.spec = ModelSpec(slot.name, slot.spec.args, preload=True)
    with pytest.raises(ValueError, match="--max-loaded-models"):
        reg.check_budget()


def test_model_of_reads_only_the_model_field():
    assert model_of(b'{"prompt": "x", "model": "m", "messages": [{"model": "other"}]}') == "m"
    assert model_of(b'{"prompt": "x"}') is None
    with pytest.raises(APIError) as info:
        model_of(b"[1, 2]")
    assert info.value.status == 400


# ---- flags and the models file ---------------------------------------------------------------

def _args(**given) -> argparse.Namespace:
    from pagoda.entrypoints.openai.server import serve_parser

    ns = serve_parser().parse_args([])
    for key, value in given.items():
        setattr(ns, key, value)
    return ns


def test_one_model_flag_is_the_single_server():
    args = _args(models=["name=/some/path"])
    fold_single_model(args)
    assert (args.model, args.served_model_name, args.models) == ("/some/path", "name", [])
    assert not wants_several_models(args)
    args = _args(model="/p", served_model_name="first", models=["two=/q"])
    fold_single_model(args)
    assert args.models == ["first=/p", "two=/q"] and args.model is None and wants_several_models(args)
    with pytest.raises(ValueError, match="--served-model-name names the positional MODEL"):
        fold_single_model(_args(served_model_name="x", models=["/p", "/q"]))


def test_split_name_keeps_paths_that_exist(tmp_path: Path):
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert split_name(str(odd)) == (None, str(odd))
    assert split_name("org/name=/x/y") == ("org/name", "/x/y")
    assert split_name("/x/y") == (None, "/x/y")


def test_models_file_gives_each_model_its_options(tmp_path: Path, llama_dir: Path):
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n"
                      f"  - name: small\n    model: {llama_dir}\n    max-model-len: 128\n    kv_cache_memory: 16MiB\n"
                      f"    preload: true\n"
                      f"  - model: {llama_dir}\n    name: other\n    dtype: float32\n")
    assert [e[0] for e in read_models_file(str(config))] == ["small", "other"]
    specs = model_specs(_args(models_config=str(config), models=[]))
    small, other = specs
    assert small.args.max_model_len == 128 and small.args.kv_cache_memory == 16 << 20 and small.preload
    assert small.max_model_len == 128 and not other.preload and other.args.max_model_len is None
    assert small.footprint > 16 << 20  # the weights on top of the KV budget
    config.write_text(f"models:\n  - model: {llama_dir}\n    frobnicate: 1\n")
    with pytest.raises(ValueError, match="unknown option 'frobnicate'"):
        model_specs(_args(models_config=str(config), models=[]))
    with pytest.raises(ValueError, match="given twice"):
        model_specs(_args(models=[f"x={llama_dir}", f"x={llama_dir}"]))
    with pytest.raises(ValueError, match="--preload names 'nope'|--preload names nope"):
        model_specs(_args(models=[f"x={llama_dir}", f"y={llama_dir}"], preload=["nope"]))


def test_lora_modules_of_a_model_route_to_it(tmp_path: Path, llama_dir: Path, lora_adapters: dict[str, Path]):
    from pagoda.entrypoints.openai.models_server import check_models_args

    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  - name: base\n    model: {llama_dir}\n"
                      f"    lora_modules: [attn8={lora_adapters['attn8']}, "
                      f"{{name: mlp, path: {lora_adapters['mlp16rs']}}}]\n"
                      f"    max_lora_rank: 16\n"
                      f"  - name: plain\n    model: {llama_dir}\n")
    args = _args(models_config=str(config), models=[])
    reg = check_models_args(args, Starter())
    assert reg.adapters == {"attn8": "base", "mlp": "base"}
    assert reg.lookup("mlp").name == "base" and reg.slots["base"].spec.args.enable_lora
    assert not reg.slots["plain"].spec.args.enable_lora
    config.write_text(f"models:\n  - name: attn8\n    model: {llama_dir}\n"
                      f"  - name: base\n    model: {llama_dir}\n    lora_modules: [attn8={lora_adapters['attn8']}]\n")
    with pytest.raises(ValueError, match="served twice"):
        check_models_args(_args(models_config=str(config), models=[]), Starter())


def test_ray_applications_take_one_model_only():
    from pagoda.entrypoints.ray.app import parse_config

    assert parse_config({"models": ["name=/m"]}).model == "/m"  # a lone --model is the model
    with pytest.raises(ValueError, match="not on Ray Serve replicas") as info:
        parse_config({"models": ["a=/m", "b=/n"]})
    assert "one application per model" in str(info.value)


def test_several_models_with_ray_flags_is_refused_naming_the_flags(capsys):
    from pagoda.entrypoints.cli import build_parser, run_serve
    from pagoda.entrypoints.ray.args import ray_flags

    assert ray_flags(argparse.Namespace(num_replicas=1, min_replicas=None, max_replicas=None,
                                        target_ongoing_requests=None, ray_address=None)) == []
    args = build_parser().parse_args(["serve", "--model", "a=/m", "--model", "b=/n", "--num-replicas", "2",
                                      "--ray-address", "local"])
    assert run_serve(args) == 1
    err = capsys.readouterr().err
    assert "not on Ray Serve replicas, which --num-replicas, --ray-address asks for" in err


def test_a_sleeping_model_is_not_unloaded_to_make_room():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, max_loaded=1)
        await reg.release(await reg.acquire("a"))
        reg.slots["a"].sleeping = 1  # put to sleep through /sleep: idle, but kept
        waiter = asyncio.create_task(reg.acquire("b"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiter.done() and loaded(reg) == ["a"] and starter.closed == []
        reg.slots["a"].sleeping = 0  # woken: the least recently used idle model again
        b = await waiter  # the load polls for room
        assert loaded(reg) == ["b"] and starter.closed == ["a"]
        await reg.release(b)
        # An operator's unload still takes a sleeping model (and it loads awake next time).
        reg.slots["b"].sleeping = 2
        await reg.unload_idle("b")
        assert reg.slots["b"].sleeping == 0 and loaded(reg) == []
        await reg.close()

    asyncio.run(run())


def test_hold_loaded_refuses_a_model_not_loaded_and_keeps_a_held_one():
    async def run() -> None:
        starter = Starter()
        reg = registry(starter, max_loaded=1)
        with pytest.raises(APIError) as info:
            async with reg.hold_loaded("a"):
                pass
        assert info.value.status == 409 and info.value.code == "model_not_loaded" and loaded(reg) == []
        await reg.release(await reg.acquire("a"))
        used = reg.slots["a"].last_used
        async with reg.hold_loaded("a-lora") as slot:  # an adapter's name holds its base model
            assert slot.name == "a" and slot.busy()
            waiter = asyncio.create_task(reg.acquire("b"))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not waiter.done() and loaded(reg) == ["a"]  # held: not unloaded under the call
        assert reg.slots["a"].last_used == used  # an operator's call is not a use
        await reg.release(await waiter)
        assert loaded(reg) == ["b"]
        await reg.close()

    asyncio.run(run())


def test_runtime_adapters_route_to_their_base_model_and_the_default_base():
    from pagoda.entrypoints.openai.models_admin import lora_base

    specs = [ModelSpec(n, argparse.Namespace(model=f"/m/{n}", enable_lora=lora, allow_runtime_lora_updating=lora))
             for n, lora in (("a", True), ("b", False), ("c", True))]
    reg = ModelRegistry(specs, Starter())
    with pytest.raises(APIError) as info:
        lora_base(reg, None)  # two models load adapters: which one must be said
    assert info.value.status == 400 and "'a', 'c'" in info.value.message
    assert lora_base(reg, "c").name == "c"
    with pytest.raises(APIError) as info:
        lora_base(reg, "b")
    assert info.value.status == 400 and "enable_lora" in info.value.message
    with pytest.raises(APIError) as info:
        lora_base(reg, "zzz")
    assert info.value.status == 404
    only = ModelRegistry(specs[:2], Starter())
    assert lora_base(only, None).name == "a"  # the only one: the default
    reg.add_adapter("sql", reg.slots["c"])
    assert reg.lookup("sql").name == "c" and reg.adapter_base("sql").name == "c"
    reg.drop_adapter("sql")
    assert reg.adapter_base("sql") is None
    with pytest.raises(APIError) as info:
        reg.lookup("sql")
    assert info.value.status == 404
