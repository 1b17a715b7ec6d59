"""KV tiers without a model: block keys, framing, the host and disk tiers, the store's threads,
and the KV-cache manager's side (which blocks go out, which come back)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from pagoda.kvcache.manager import KVCacheManager
from pagoda.kvcache.tiers.base import frame, unframe
from pagoda.kvcache.tiers.disk import SUFFIX, DiskTier
from pagoda.kvcache.tiers.host import HostTier
from pagoda.kvcache.tiers.keys import BlockHasher, files_fingerprint, namespace_bytes
from pagoda.kvcache.tiers.store import TieredStore
from pagoda.lora.request import LoRARequest
from pagoda.request import Request, Sequence
from pagoda.sampling_params import SamplingParams

KEY = b"k" * 16


def test_frame_detects_corruption_truncation_and_a_wrong_key():
    data = frame(KEY, b"payload bytes")
    assert unframe(KEY, data) == b"payload bytes"
    assert unframe(KEY, data[:-1]) is None
    assert unframe(KEY, data[:10]) is None
    flipped = bytearray(data)
    flipped[-3] ^= 1
    assert unframe(KEY, bytes(flipped)) is None
    assert unframe(b"x" * 16, data) is None  # a block stored under another key


def test_block_keys_chain_tokens_namespace_and_identity(tmp_path):
    h = BlockHasher(b"model-a")
    root = h.root(None)
    keys = h.keys(root, list(range(48)), 16, 0, 3)
    assert len(set(keys)) == 3
    assert h.keys(keys[0], list(range(48)), 16, 1, 3) == keys[1:]  # the chain continues from any block
    # The same block after a different first block has another key (the chain, not the block alone).
    other = h.keys(root, [99] + list(range(1, 48)), 16, 0, 3)
    assert other[1] != keys[1] and other[2] != keys[2]
    assert BlockHasher(b"model-b").keys(BlockHasher(b"model-b").root(None), list(range(48)), 16, 0, 1)[0] != keys[0]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    lora = LoRARequest("a", 1, str(adapter))
    roots = {h.root(None), h.root(lora), h.root((None, "salt")), h.root((lora, "salt"))}
    assert len(roots) == 4
    # The engine-local id does not matter; the adapter's files do.
    assert namespace_bytes(LoRARequest("a", 7, str(adapter))) == namespace_bytes(lora)
    before = files_fingerprint(str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-two")
    assert files_fingerprint(str(adapter)) != before


def test_host_tier_keeps_its_byte_budget_least_recently_used_first():
    tier = HostTier(3 * len(frame(KEY, b"x" * 100)))
    keys = [bytes([i]) * 16 for i in range(4)]
    for k in keys[:3]:
        tier.put(k, b"x" * 100)
    assert tier.get(keys[0]) == b"x" * 100  # now the most recently used
    tier.put(keys[3], b"x" * 100)
    assert tier.get(keys[1]) is None and tier.get(keys[0]) is not None and len(tier) == 3
    assert tier.used <= tier.capacity


def test_disk_tier_survives_a_restart_drops_corrupt_blocks_and_keeps_its_budget(tmp_path):
    size = len(frame(KEY, b"y" * 64))
    tier = DiskTier(str(tmp_path), 4 * size)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, k in enumerate(keys):
        tier.put(k, bytes([i]) * 64)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # written atomically
    again = DiskTier(str(tmp_path), 4 * size)  # a restarted engine
    assert len(again) == 3 and again.get(keys[2]) == bytes([2]) * 64
    path = tmp_path / (keys[1].hex() + SUFFIX)
    path.write_bytes(path.read_bytes()[:-5])  # truncated
    assert again.get(keys[1]) is None and not path.exists() and not again.contains(keys[1])
    for i in range(3, 8):
        again.put(bytes([i]) * 16, b"z" * 64)
    assert again.used <= 4 * size and len(os.listdir(tmp_path)) == len(again) == 4


def test_store_lookup_reads_the_chain_up_to_the_first_missing_block(tmp_path):
    host, disk = HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)
    store = TieredStore([host, disk])
    try:
        keys = [bytes([i]) * 16 for i in range(4)]
        host.put(keys[0], b"a")
        disk.put(keys[1], b"b")
        disk.put(keys[3], b"d")  # after a gap: useless
        job = store.lookup_async(keys, 2, 80)
        assert job.wait(10)
        assert job.payloads == [b"a", b"b"] and job.sources == ["cpu", "disk"]
        assert store.stats.hits == {"cpu": 1, "disk": 1} and store.stats.misses == 1
        assert store.stats.bytes_read == {"cpu": 1, "disk": 1} and store.stats.read_s["disk"] > 0
        from pagoda.kvcache.tiers.base import SaveItem

        store.save_async([SaveItem(0, keys[2], ("cpu", "disk"))], lambda: [b"c"])
        store.drain()
        assert host.get(keys[2]) == b"c" and disk.get(keys[2]) == b"c"
    finally:
        store.close()


def _seq(tokens: list[int]) -> Sequence:
    req = Request("r", tokens, SamplingParams(max_tokens=1), (0,))
    return Sequence("r#0", req, list(tokens))


def test_manager_saves_evicted_blocks_and_brings_them_back_into_free_blocks():
    """The scheduler's side alone, with a dict standing in for the device blocks: evicted
    blocks are snapshotted under their keys; a prompt that misses in the radix tree but hits
    the host tier waits while they load, then matches them in new device blocks."""
    store = TieredStore([HostTier(1 << 20)])
    device: dict[int, bytes] = {}
    try:
        kv = KVCacheManager(num_blocks=6, block_size=4)
        kv.attach_tiers(store, b"identity")
        tokens = list(range(10, 23))  # 3 full blocks + 1 token
        seq = _seq(tokens)
        assert kv.extend_from_tiers(seq, kv.match_prefix(seq)).num_tokens == 0  # nothing anywhere: no wait
        assert kv.allocate(seq, len(tokens), kv.match_prefix(seq))
        for i, block in enumerate(seq.block_table):
            device[block] = f"kv of block {i}".encode()
        seq.num_computed_tokens = len(tokens)
        kv.cache_blocks(seq)
        kv.free(seq)
        assert kv.take_transfers() is None  # host tier only: nothing written through
        assert kv.reset_prefix_cache() == 3
        out = kv.take_transfers()
        assert sorted(device[s.block] for s in out.saves) == [f"kv of block {i}".encode() for i in range(3)]
        store.save_async(out.saves, lambda: [device[s.block] for s in out.saves])
        store.drain()
        for block in list(device):
            device[block] = b"overwritten"
        again = _seq(tokens)
        prefix = kv.extend_from_tiers(again, kv.match_prefix(again))  # host memory: no wait
        assert prefix.num_tokens == 12 and store.stats.hits["cpu"] == 3
        loads = kv.take_transfers().loads
        for block, payload in loads:
            device[block] = payload
        assert [device[n.block] for n in prefix.nodes] == [f"kv of block {i}".encode() for i in range(3)]
        kv.check_invariants([])
    finally:
        store.close()


def test_a_prompt_waits_while_its_blocks_load_from_disk_and_host_hits_do_not_wait(tmp_path):
    """Disk (I/O) is read on the loader thread while the request waits a step; blocks in host
    memory are taken at once, unless a later block may be on disk (then the loader reads all)."""
    host, disk = HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)
    store = TieredStore([host, disk])
    try:
        kv = KVCacheManager(num_blocks=8, block_size=4)
        kv.attach_tiers(store, b"identity")
        tokens = list(range(13))
        keys = kv.tiers.hasher.keys(kv.cache.root.digest, tokens, 4, 0, 3)
        host.put(keys[0], b"p0")
        disk.put(keys[1], b"p1")
        seq = _seq(tokens)
        assert kv.extend_from_tiers(seq, kv.match_prefix(seq)) is None  # block 1 is on disk: it waits
        store.drain()
        assert kv.extend_from_tiers(seq, kv.match_prefix(seq)).num_tokens == 8
        assert [p for _, p in kv.take_transfers().loads] == [b"p0", b"p1"]
        assert store.stats.hits == {"cpu": 1, "disk": 1} and store.stats.misses == 1
        other = _seq(tokens[:4] + [99] * 9)  # block 0 in host memory (and the device now), then nothing
        kv.reset_prefix_cache()
        kv.take_transfers()
        store.drain()
        assert kv.extend_from_tiers(other, kv.match_prefix(other)).num_tokens == 4  # at once
    finally:
        store.close()


def test_queued_prompts_read_their_blocks_on_arrival_up_to_the_limit(tmp_path):
    """``prefetch`` (the scheduler calls it as a request is queued) starts the tier lookup, so a
    prompt reached later finds its blocks read and starts at once; past ``PREFETCH_LIMIT``
    queued prompts a prompt asks when it is reached (and waits a step)."""
    from pagoda.kvcache.manager import PREFETCH_LIMIT

    disk = DiskTier(str(tmp_path), 1 << 20)
    store = TieredStore([disk])
    try:
        kv = KVCacheManager(num_blocks=32, block_size=4)
        kv.attach_tiers(store, b"identity")
        seqs = []
        for i in range(PREFETCH_LIMIT + 1):
            tokens = [100 + i] * 4 + [7] * 5
            disk.put(kv.tiers.hasher.keys(kv.cache.root.digest, tokens, 4, 0, 1)[0], f"block {i}".encode())
            req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1), (0,))
            seqs.append(Sequence(f"r{i}#0", req, list(tokens)))
        for seq in seqs:
            kv.prefetch(seq)
        store.drain()
        assert store.stats.hits["disk"] == PREFETCH_LIMIT
        for seq in seqs[:-1]:
            assert kv.extend_from_tiers(seq, kv.match_prefix(seq)).num_tokens == 4  # read already
        assert kv.extend_from_tiers(seqs[-1], kv.match_prefix(seqs[-1])) is None  # asks only now
        store.drain()
        assert kv.extend_from_tiers(seqs[-1], kv.match_prefix(seqs[-1])).num_tokens == 4
        assert sorted(p for _, p in kv.take_transfers().loads) == sorted(f"block {i}".encode() for i in range(len(seqs)))
        kv.check_invariants([])
    finally:
        store.close()


def test_a_block_evicted_before_its_load_ran_is_neither_loaded_nor_saved():
    store = TieredStore([HostTier(1 << 20)])
    try:
        kv = KVCacheManager(num_blocks=3, block_size=4)
        kv.attach_tiers(store, b"identity")
        tokens = list(range(9))
        root = kv.cache.root.digest
        keys = kv.tiers.hasher.keys(root, tokens, 4, 0, 2)
        for k in keys:
            store.tiers[0].put(k, b"p")
        seq = _seq(tokens)
        assert kv.extend_from_tiers(seq, kv.match_prefix(seq)).num_tokens == 8  # host memory: at once
        kv.reset_prefix_cache()  # evicted before any step ran the loads
        out = kv.take_transfers()
        assert out is None or (not out.loads and not out.saves)
    finally:
        store.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_block_payloads_round_trip_through_the_store_with_their_scales(dtype):
    """The model runner's codec: blocks snapshotted, stored, and loaded into other blocks come
    back bit for bit, values and (quantized caches) scales."""
    import torch

    from pagoda.executor.kv_offload import KVBlockCodec
    from pagoda.kvcache.tiers.base import KVTransfers, SaveItem

    torch.manual_seed(0)
    shape = (2, 2, 6, 4, 2, 8)  # layers, planes, blocks, block size, heads, width
    if dtype == "int8":
        cache = torch.randint(-127, 128, shape, dtype=torch.int8)
        scales = torch.rand(shape[:-1]).to(torch.bfloat16)
    else:
        cache, scales = torch.randn(shape).to(getattr(torch, dtype)), None
    store = TieredStore([HostTier(1 << 20)])
    try:
        codec = KVBlockCodec(cache, scales, store)
        keys = [bytes([i]) * 16 for i in range(2)]
        want = cache[:, :, [1, 4]].clone(), scales[:, :, [1, 4]].clone() if scales is not None else None
        codec.transfer(KVTransfers(saves=[SaveItem(1, keys[0], ("cpu",)), SaveItem(4, keys[1], ("cpu",))]))
        cache[:, :, [1, 4]] = 0  # the blocks are reused right away: the snapshot was taken already
        store.drain()
        job = store.lookup_async(keys, 0, 9)
        assert job.wait(10) and len(job.payloads) == 2
        codec.transfer(KVTransfers(loads=[(5, job.payloads[0]), (0, job.payloads[1])]))
        assert torch.equal(cache[:, :, [5, 0]], want[0])
        if scales is not None:
            assert torch.equal(scales[:, :, [5, 0]], want[1])
    finally:
        store.close()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_cuda_cache_moves_through_pinned_host_memory():
    """On a GPU the codec's snapshots are pinned host tensors (full-speed DMA) and loads come
    back bit for bit through pinned staging."""
    import torch

    from pagoda.executor.kv_offload import KVBlockCodec

    cache = torch.randn(2, 2, 6, 4, 2, 8, device="cuda").to(torch.bfloat16)
    codec = KVBlockCodec(cache, None, None)
    snap = codec.snapshot([1, 4])
    assert snap.device.type == "cpu" and snap.is_pinned()
    want = cache[:, :, [1, 4]].clone()
    codec.write([5, 0], snap.numpy())
    torch.cuda.synchronize()
    assert torch.equal(cache[:, :, [5, 0]], want)


def test_tier_totals_become_prometheus_counters_per_tier_and_event():
    from pagoda.engine.messages import SchedulerStats
    from pagoda.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.on_engine_stats(SchedulerStats(kv_offload={"cpu/hit": 3, "disk/saved": 5, "all/miss": 1}))
    metrics.on_engine_stats(SchedulerStats(kv_offload={"cpu/hit": 7, "disk/saved": 5, "all/miss": 2,
                                                       "disk/written_bytes": 4096, "disk/write_us": 1500000}))
    text = metrics.render()[0].decode()
    assert 'pagoda:kv_offload_blocks_total{event="hit",model_name="m",tier="cpu"} 7.0' in text
    assert 'pagoda:kv_offload_blocks_total{event="saved",model_name="m",tier="disk"} 5.0' in text
    assert 'pagoda:kv_offload_blocks_total{event="miss",model_name="m",tier="all"} 2.0' in text
    assert 'pagoda:kv_offload_bytes_total{direction="written",model_name="m",tier="disk"} 4096.0' in text
    assert 'pagoda:kv_offload_seconds_total{direction="write",model_name="m",tier="disk"} 1.5' in text


def test_model_identity_changes_with_weights_dtypes_block_size_and_layout(tmp_path):
    import dataclasses

    import torch

    from pagoda.kvcache.tiers.keys import model_identity

    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    (tmp_path / "config.json").write_text("{}")
    model = SimpleNamespace(path=str(tmp_path), architecture="llama", dtype=torch.float32, quantization=None,
                            quantization_config=None, load_format="auto")

    @dataclasses.dataclass
    class Cfg:
        model: SimpleNamespace
        cache: SimpleNamespace
        parallel: SimpleNamespace
        seed: int = 0

    def ident(**changes) -> bytes:
        m = SimpleNamespace(**{**vars(model), **changes.get("model", {})})
        cache = SimpleNamespace(**{"block_size": 16, "kv_cache_dtype": torch.float32, **changes.get("cache", {})})
        par = SimpleNamespace(**{"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                 **changes.get("parallel", {})})
        return model_identity(Cfg(m, cache, par))  # type: ignore[arg-type]

    base = ident()
    assert ident() == base  # stable: a restarted engine agrees
    variants = [ident(model={"dtype": torch.bfloat16}), ident(cache={"kv_cache_dtype": torch.int8}),
                ident(parallel={"tensor_parallel_size": 2}), ident(model={"quantization": "int8"})]
    variants.append(ident(cache={"block_size": 32}))
    (tmp_path / "model.safetensors").write_bytes(b"v" * 101)  # retrained weights
    variants.append(ident())
    assert len({base, *variants}) == len(variants) + 1


@pytest.mark.parametrize("changes, message", [
    ({"kv_offload_disk_bytes": 1 << 20}, "needs kv_offload_disk_path"),
    ({"kv_offload_cpu_bytes": 1 << 20, "enable_prefix_caching": False}, "need enable_prefix_caching"),
    ({"kv_offload_cpu_bytes": 1 << 20, "enable_sleep_mode": True}, "enable_sleep_mode"),
    ({"kv_offload_redis_url": "localhost:6379"}, "redis://"),
    ({"kv_offload_cpu_bytes": -5}, "positive"),
])
def test_offload_flags_are_checked_at_start_up(llama_dir, changes, message):
    from pagoda.config import EngineArgs, EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), **changes))


def test_offload_flags_parse_sizes(llama_dir, tmp_path):
    import argparse

    from pagoda.config import EngineArgs, EngineConfig

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", str(llama_dir), "--kv-offload-cpu-bytes", "2GiB",
                            "--kv-offload-disk-path", str(tmp_path), "--kv-offload-disk-bytes", "512MiB"])
    off = EngineConfig.from_args(EngineArgs.from_namespace(ns)).cache.offload
    assert (off.cpu_bytes, off.disk_path, off.disk_bytes, off.redis_url) == (2 << 30, str(tmp_path), 512 << 20, None)


def test_a_lookup_waits_for_the_queued_write_of_its_block():
    import threading

    from pagoda.kvcache.tiers.base import SaveItem

    store = TieredStore([HostTier(1 << 20)])
    gate = threading.Event()
    try:
        key = b"w" * 16
        store.save_async([SaveItem(0, key, ("cpu",))], lambda: [b"late"] if gate.wait(10) else [])
        assert store.may_hold(key)  # queued, not written yet
        job = store.lookup_async([key], 0, 17)
        assert not job.wait(0.1)  # waiting for the write
        gate.set()
        assert job.wait(10) and job.payloads == [b"late"]
    finally:
        gate.set()
        store.close()


def test_the_periodic_stats_line_shows_tier_hits_over_the_interval():
    from pagoda.engine.messages import SchedulerStats
    from pagoda.entrypoints.openai.stat_logger import StatLogger

    now = [0.0]
    logger = StatLogger(interval_s=5.0, clock=lambda: now[0])
    logger.on_engine_stats(SchedulerStats(num_running=1, kv_offload={"cpu/hit": 4, "disk/hit": 1, "all/miss": 2}))
    now[0] += 5
    logger.log()
    logger.on_engine_stats(SchedulerStats(num_running=1, kv_offload={"cpu/hit": 10, "disk/hit": 1, "all/miss": 3}))
    now[0] += 5
    assert logger.log().endswith("KV tier block hits cpu 6 disk 0")
