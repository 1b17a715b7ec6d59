"""KV tiers under tensor and pipeline parallelism (2 gloo ranks on CPU): every rank moves its own
share of each block (its KV heads, its stage's layers), rank 0's store keeps the ranks' shares
together under the block's one key. Greedy outputs with tiers on equal tiers off across
eviction and restore (host memory, disk), a restarted engine serves a known prefix from disk and
from Redis, and the ranks' shares never mix (nor do layouts)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from pagoda import LLM
from tests.kvcache.test_tiers_engine import assert_same, prompts, run

BS = 16
LAYER_BYTES = 2 * BS * 2 * 16 * 4  # one layer of a block: K and V, 2 KV heads of 16, float32
# 64 blocks per rank. Two tensor-parallel ranks hold one KV head each of the 2-layer model; two
# pipeline stages of a 3-layer model hold 1 layer (rank 0, the last stage) and 2 layers: shares
# of different sizes.
TP = dict(kv_cache_memory=64 * LAYER_BYTES, max_model_len=512, tensor_parallel_size=2)
LAYOUTS = {"tp2": (2, TP), "pp2-uneven": (3, dict(kv_cache_memory=128 * LAYER_BYTES, max_model_len=512,
                                                  pipeline_parallel_size=2))}
RETURNING = prompts(1, 2, 160)  # 10 full blocks each
OTHER = prompts(2, 4, 200)  # 52 blocks: evicts most of RETURNING from the 64-block device pool


@pytest.fixture(params=LAYOUTS.values(), ids=LAYOUTS.keys())
def layout(request, model_factory):
    """A model, an engine layout of two ranks, its number of layers, and the outputs of
    RETURNING with tiers off in that layout, which every tiered run must reproduce."""
    layers, args = request.param
    path = model_factory("llama", num_layers=layers)
    llm = LLM(str(path), **args)
    try:
        return path, args, layers, run(llm, RETURNING)
    finally:
        llm.shutdown()


def test_prefixes_come_back_from_host_memory_and_a_restart_finds_them_on_disk(layout, tmp_path):
    llama_dir, args, layers, reference = layout
    llm = LLM(str(llama_dir), **args, kv_offload_cpu_bytes=16 << 20, kv_offload_disk_path=str(tmp_path))
    try:
        core = llm.engine.core
        assert core.kv.num_blocks == 64
        # A payload is every rank's share: the whole block, every layer and head.
        assert core.kv_store.payload_bytes == sum(core.executor.kv_offload.shares) == layers * LAYER_BYTES
        first = run(llm, RETURNING)
        assert_same(first, reference)
        run(llm, OTHER)
        assert core.kv.stats.evictions > 0
        core.kv_store.drain()
        again = run(llm, RETURNING)
        assert core.kv_store.stats.hits["cpu"] > 0
        assert all(o.num_cached_tokens >= 8 * BS for o in again)
        assert_same(again, reference)
    finally:
        llm.shutdown()  # writes what the engine still owes the disk
    assert len(list(tmp_path.glob("*.kvblock"))) >= 20

    restarted = LLM(str(llama_dir), **args, kv_offload_disk_path=str(tmp_path))
    try:
        core = restarted.engine.core
        out = run(restarted, RETURNING)
        assert core.kv_store.stats.hits["disk"] >= 18
        assert all(o.num_cached_tokens >= 0.9 * len(p) for o, p in zip(out, RETURNING))
        assert_same(out, reference)
        # The disk payload of a prompt's first block: rank 0's share is what rank 0's cache
        # holds for it now; rank 1's share (its KV head, or its stage's layer) is other bytes.
        kv = core.kv
        key = kv.tiers.hasher.keys(kv.cache.root.digest, RETURNING[0], BS, 0, 1)[0]
        payload = core.kv_store.by_name["disk"].get(key)
        block = kv.cache.match(RETURNING[0])[0].block
        share = core.executor.kv_offload.codec.block_bytes
        assert len(payload) == layers * LAYER_BYTES and payload[:share] != payload[share:2 * share]
        assert core.executor.kv_offload.codec.snapshot([block]).numpy().tobytes() == payload[:share]
    finally:
        restarted.shutdown()


def test_one_rank_never_reuses_a_tp_engines_blocks(llama_dir, tmp_path):
    """The tensor-parallel layout is part of every key: a TP=2 engine's blocks (both shares in
    one payload) are misses for a one-rank engine on the same directory, and the other way."""
    llm = LLM(str(llama_dir), **TP, kv_offload_disk_path=str(tmp_path))
    try:
        run(llm, RETURNING[:1])
    finally:
        llm.shutdown()
    tp_files = set(tmp_path.glob("*.kvblock"))
    assert len(tp_files) >= 10
    single = LLM(str(llama_dir), kv_cache_memory=512 << 10, max_model_len=512, kv_offload_disk_path=str(tmp_path))
    try:
        assert run(single, RETURNING[:1])[0].num_cached_tokens == 0
        single.engine.core.kv_store.drain()
    finally:
        single.shutdown()
    assert len(set(tmp_path.glob("*.kvblock")) - tp_files) >= 10  # its own keys, beside the TP=2 ones


@pytest.fixture()
def redis_url(tmp_path):
    """A redis-server of this test's own on a free loopback port."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    redis = pytest.importorskip("redis", reason="the redis client package is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client, deadline = redis.Redis(port=port), time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def test_a_restarted_tp_engine_finds_every_ranks_share_in_redis(llama_dir, redis_url):
    known = RETURNING[:1]
    llm = LLM(str(llama_dir), **TP, kv_offload_redis_url=redis_url)
    try:
        first = run(llm, known)
    finally:
        llm.shutdown()  # finishes the queued writes
    restarted = LLM(str(llama_dir), **TP, kv_offload_redis_url=redis_url)
    try:
        again = run(restarted, known)
        assert restarted.engine.core.kv_store.stats.hits["redis"] >= 9
        assert again[0].num_cached_tokens >= 0.9 * len(known[0])
        assert_same(again, first)
    finally:
        restarted.shutdown()
