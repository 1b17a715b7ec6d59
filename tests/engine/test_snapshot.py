"""The dashboard's engine snapshot, built on a real KV-cache manager without a model: the hot
prefixes (length, hits, salted ones without token ids), the request list and its per-priority and
per-adapter counts, and that the whole snapshot crosses the wire as a utility result."""
from __future__ import annotations

import msgspec

from pagoda.engine.messages import CoreOutputMsg, UtilityResultMsg
from pagoda.engine.snapshot import PREVIEW_TOKENS, _requests, hot_prefixes, kernel_choice
from pagoda.engine.snapshot import EngineSnapshot
from pagoda.kvcache.manager import KVCacheManager
from pagoda.lora.request import LoRARequest
from pagoda.request import Request, SeqStatus, Sequence
from pagoda.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], rid: str, salt: str | None = None, priority: int = 0,
             lora: LoRARequest | None = None, arrival: float = 0.0) -> Sequence:
    req = Request(rid, list(tokens), SamplingParams(max_tokens=8), (0,), arrival_time=arrival, cache_salt=salt,
                  priority=priority, lora_request=lora)
    return Sequence(rid + "#0", req, list(tokens))


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    prefix = kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)
    return prefix.num_tokens


def test_hot_prefix_is_the_longest_path_every_hit_followed() -> None:
    kv = KVCacheManager(64, BS)
    system = list(range(100, 112))  # three full blocks shared by every request
    seqs = [make_seq(system + [200 + i] * 5, f"r{i}") for i in range(4)]
    for seq in seqs:
        admit(kv, seq)
    # A fifth request shares only the first block.
    admit(kv, make_seq(system[:4] + [7] * 9, "other"))
    top = hot_prefixes(kv.cache, 5)
    assert len(top) == 2  # blocks nobody matched again are no prefix
    # The first block has one hit more (the fifth request) than the rest: its own prefix, first.
    assert (top[0].num_tokens, top[0].hits) == (4, 4)
    assert top[1].num_tokens == 12 and top[1].hits == 3  # three later requests matched all of it
    assert top[1].preview_token_ids == system and not top[1].salted
    assert top[1].referenced  # the requests still hold their blocks
    assert top[0].hash != top[1].hash


def test_salted_prefixes_carry_no_tokens() -> None:
    kv = KVCacheManager(64, BS)
    secret = list(range(50, 62))
    for i in range(3):
        admit(kv, make_seq(secret + [i], f"s{i}", salt="tenant-a"))
    (top,) = hot_prefixes(kv.cache, 5)
    assert top.salted and top.preview_token_ids is None
    assert (top.num_tokens, top.hits) == (12, 2)


def test_preview_is_bounded() -> None:
    kv = KVCacheManager(256, BS)
    long = list(range(1, 201))
    admit(kv, make_seq(long + [0], "a"))
    admit(kv, make_seq(long + [1], "b"))
    (top,) = hot_prefixes(kv.cache, 5)
    assert top.num_tokens == 200 and top.preview_token_ids == long[:PREVIEW_TOKENS]


def test_requests_counted_once_and_listed_within_the_limit() -> None:
    lora = LoRARequest("sql", 1, "/nowhere")
    running = [make_seq([1, 2, 3], "a", priority=1, lora=lora, arrival=1.0)]
    running[0].status = SeqStatus.RUNNING
    running[0].token_ids += [4, 5]  # two output tokens
    # Request "b" has two samples, one running and one waiting: it counts once, as running.
    b0 = make_seq([9, 9], "b", arrival=2.0)
    b1 = Sequence("b#1", b0.request, [9, 9], sample_index=1)
    waiting = [make_seq([7], f"w{i}", priority=5, arrival=10.0 - i) for i in range(3)] + [b1]
    listed, by_priority, by_adapter = _requests(running + [b0], waiting, limit=3)
    assert [r.request_id for r in listed] == ["a", "b", "w2"]  # running first, then the oldest waiting
    assert listed[0].num_output_tokens == 2 and listed[0].adapter == "sql" and listed[0].state == "running"
    assert listed[1].num_samples == 2 and listed[1].state == "running"
    assert by_priority == {"running": {"1": 1, "0": 1}, "waiting": {"5": 3}}
    assert by_adapter == {"running": {"sql": 1, "": 1}, "waiting": {"": 3}}


def test_snapshot_crosses_the_wire_as_a_utility_result() -> None:
    kv = KVCacheManager(64, BS)
    for i in range(3):
        admit(kv, make_seq(list(range(12)) + [i], f"r{i}"))
    listed, by_priority, by_adapter = _requests([], [], 8)
    snap = EngineSnapshot(time=1.0, num_running=0, num_waiting=0, requests=listed, num_blocks=64, block_size=BS,
                          num_free_blocks=50, num_cached_blocks=4, num_used_blocks=10,
                          prefixes=hot_prefixes(kv.cache, 3), by_priority=by_priority, by_adapter=by_adapter,
                          kernel=kernel_choice("cpu"))
    wire = msgspec.msgpack.encode(UtilityResultMsg(3, snap))
    got = msgspec.msgpack.Decoder(CoreOutputMsg).decode(wire)
    assert isinstance(got, UtilityResultMsg) and got.result == snap
    assert msgspec.to_builtins(got.result.prefixes[0])["num_tokens"] == 12  # named fields for JSON


def test_kernel_choice_names_the_level_or_why_not(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    assert kernel_choice("cpu")["level"] == "off"
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    monkeypatch.setenv("PAGODA_CPU_ISA", "scalar")
    assert kernel_choice("cpu")["level"] == "scalar" and kernel_choice("cpu")["variant"] == "scalar"
    assert kernel_choice("cuda")["level"] == "cuda"


def test_tiers_report_what_they_know_without_io(tmp_path) -> None:
    from types import SimpleNamespace

    from pagoda.engine.snapshot import _tiers
    from pagoda.kvcache.tiers.disk import DiskTier
    from pagoda.kvcache.tiers.host import HostTier

    host, disk = HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)
    for i in range(3):
        host.put(bytes([i]) * 16, b"x" * 100)
    disk.put(b"k" * 16, b"y" * 50)
    remote = SimpleNamespace(name="redis")  # a shared store cannot count its blocks locally
    got = _tiers(SimpleNamespace(kv_store=SimpleNamespace(tiers=[host, disk, remote])))  # type: ignore[arg-type]
    assert [(t.name, t.num_blocks, t.capacity_bytes) for t in got] == [
        ("cpu", 3, 1 << 20), (disk.name, 1, 1 << 20), ("redis", None, None)]
    assert got[0].used_bytes == host.used >= 300 and got[1].used_bytes == disk.used >= 50  # payloads (+ any framing)
    assert _tiers(SimpleNamespace(kv_store=None)) == []  # type: ignore[arg-type]
