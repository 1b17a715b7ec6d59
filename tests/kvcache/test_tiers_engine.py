"""KV tiers in a running engine: outputs with tiers on equal tiers off (greedy tokens, logprobs)
for prefixes evicted from the device and loaded back, for a restarted engine (disk), across two
engines (Redis); a changed model identity never reuses a block; Redis down means recomputation."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

import pytest

from pagoda import LLM, SamplingParams

BS = 16
KV = dict(kv_cache_memory=512 << 10, max_model_len=512)  # 64 blocks of 8 KiB (this model, float32)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, batch: list[list[int]], params: SamplingParams = PARAMS):
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Tiers off: the outputs every tiered run must reproduce."""
    llm = LLM(str(llama_dir), **KV)
    yield llm
    llm.shutdown()


def test_prefixes_evicted_by_other_traffic_come_back_from_host_memory(llama_dir, reference):
    llm = LLM(str(llama_dir), **KV, kv_offload_cpu_bytes=16 << 20, long_prefill_token_threshold=48)
    try:
        core = llm.engine.core
        returning = prompts(1, 2, 160)  # 10 full blocks each
        first = run(llm, returning)
        run(llm, prompts(2, 4, 200))  # other traffic: 52 blocks, the device has 64
        assert core.kv.stats.evictions > 0
        core.kv_store.drain()
        hits_before = sum(core.kv_store.stats.hits.values())
        again = run(llm, returning)
        assert sum(core.kv_store.stats.hits.values()) > hits_before
        assert core.stats().kv_offload["cpu/hit"] == core.kv_store.stats.hits["cpu"] > 0
        assert all(o.num_cached_tokens >= 8 * BS for o in again)  # mostly from the host tier
        want = run(reference, returning)
        assert_same(first, want)
        assert_same(again, want)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
        run(llm, prompts(9, 4, 200))  # evict the returning prefixes again
        got = [o.outputs[0].token_ids for o in run(llm, returning, seeded)]
        assert got == [o.outputs[0].token_ids for o in run(reference, returning, seeded)]
        # Preemption under tiers: a batch that outgrows the device, its prefixes partly reloaded.
        long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=3)
        batch = [returning[0][:144] + prompts(7, 1, 56)[0]] + prompts(8, 3, 200)  # 4 x 13 blocks, then 17
        preemptions = core.scheduler.num_preemptions
        got = run(llm, batch, long)
        assert core.scheduler.num_preemptions > preemptions
        assert_same(got, run(reference, batch, long))
        core.kv.check_invariants(core.scheduler.running)
    finally:
        llm.shutdown()


def test_a_restarted_engine_reuses_blocks_from_disk_and_drops_a_corrupt_one(llama_dir, reference, tmp_path):
    known = prompts(3, 1, 200)  # 12 full blocks
    llm = LLM(str(llama_dir), **KV, kv_offload_disk_path=str(tmp_path))
    try:
        first = run(llm, known)
    finally:
        llm.shutdown()  # writes what the engine still owes the disk
    assert len(list(tmp_path.glob("*.kvblock"))) >= 12
    restarted = LLM(str(llama_dir), **KV, kv_offload_disk_path=str(tmp_path))
    try:
        again = run(restarted, known)
        assert again[0].num_cached_tokens >= 0.9 * len(known[0])
        assert_same(again, run(reference, known))
        assert_same(first, again)
    finally:
        restarted.shutdown()
    # One block of the chain corrupted on disk: detected by its checksum, dropped, recomputed
    # (with every block after it: a block is only usable after its whole prefix).
    third = LLM(str(llama_dir), **KV, kv_offload_disk_path=str(tmp_path))
    try:
        kv = third.engine.core.kv
        keys = kv.tiers.hasher.keys(kv.cache.root.digest, known[0], BS, 0, 6)
        path = tmp_path / (keys[5].hex() + ".kvblock")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        out = run(third, known)
        assert out[0].num_cached_tokens == 5 * BS
        assert not path.exists() or path.read_bytes() != bytes(data)  # the corrupt file is gone (or rewritten)
        assert_same(out, again)
    finally:
        third.shutdown()


def test_a_changed_kv_dtype_or_cache_salt_never_reuses_blocks(llama_dir, tmp_path):
    known = prompts(4, 1, 100)
    llm = LLM(str(llama_dir), **KV, kv_offload_disk_path=str(tmp_path))
    try:
        run(llm, known)
    finally:
        llm.shutdown()
    other = LLM(str(llama_dir), **KV, kv_offload_disk_path=str(tmp_path), kv_cache_dtype="bfloat16")
    try:
        assert run(other, known)[0].num_cached_tokens == 0
    finally:
        other.shutdown()
    same = LLM(str(llama_dir), **KV, kv_offload_disk_path=str(tmp_path))
    try:
        salted = same.generate([{"prompt_token_ids": known[0], "cache_salt": "tenant-b"}], PARAMS, use_tqdm=False)
        assert salted[0].num_cached_tokens == 0
        assert run(same, known)[0].num_cached_tokens == 96
    finally:
        same.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def redis_url(tmp_path):
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="the redis client package is not installed")
    port = _free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    yield SimpleProc(proc, f"redis://127.0.0.1:{port}/0")
    proc.kill()
    proc.wait()


class SimpleProc:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url


def test_two_engines_share_prefixes_through_redis_and_survive_it_going_away(llama_dir, reference, redis_url):
    shared = prompts(5, 2, 120)  # 7 full blocks each
    a = LLM(str(llama_dir), **KV, kv_offload_redis_url=redis_url.url)
    b = LLM(str(llama_dir), **KV, kv_offload_redis_url=redis_url.url)
    try:
        first = run(a, shared)
        a.engine.core.kv_store.drain()
        second = run(b, shared)  # the other replica: its own device cache is empty
        assert all(o.num_cached_tokens == 112 for o in second)
        assert b.engine.core.kv_store.stats.hits["redis"] >= 14
        want = run(reference, shared)
        assert_same(first, want)
        assert_same(second, want)
        redis_url.proc.kill()
        redis_url.proc.wait()
        # Redis gone: both engines recompute; no request fails.
        fresh = prompts(6, 2, 120)
        assert_same(run(b, fresh), run(reference, fresh))
        b.reset_prefix_cache()
        assert_same(run(b, shared), want)
    finally:
        a.shutdown()
        b.shutdown()


def test_redis_stopped_in_the_middle_of_a_batch_fails_no_request(llama_dir, reference, redis_url):
    """redis-server is killed in the batch's first step (when the first blocks go to the Redis
    writer; five requests still wait); every request completes with the tiers-off output, and
    so do the evicted prefixes asked for next, which are looked up in the dead Redis: 0 failed
    requests."""
    batch = prompts(8, 6, 200)  # 13 blocks each: more than the 64-block device cache holds
    llm = LLM(str(llama_dir), **KV, kv_offload_redis_url=redis_url.url, max_num_seqs=1)
    store = llm.engine.core.kv_store
    tier = store.by_name["redis"]
    killed, reads_after = [], []
    save_async, get_many = store.save_async, tier.get_many

    def die_then_save(items, payloads):
        if not killed:
            redis_url.proc.kill()
            redis_url.proc.wait()
            killed.append(True)
        return save_async(items, payloads)

    def counted_get_many(keys):
        if killed:
            reads_after.append(len(keys))
        return get_many(keys)

    store.save_async, tier.get_many = die_then_save, counted_get_many
    try:
        out = run(llm, batch)
        assert killed and tier.errors >= 1
        again = run(llm, batch[:3])  # evicted from the device by the later prompts
        assert reads_after and store.stats.hits["redis"] == 0
        for o in out + again:
            assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 8
        assert_same(out, run(reference, batch))
        assert_same(again, out[:3])
    finally:
        llm.shutdown()


def test_redis_tier_drops_a_corrupt_block_and_degrades_to_misses_when_down(redis_url):
    import redis

    from pagoda.kvcache.tiers.redis import KEY_PREFIX, RedisTier

    tier = RedisTier(redis_url.url)
    key = b"r" * 16
    tier.put(key, b"payload")
    assert tier.get(key) == b"payload"
    client = redis.Redis.from_url(redis_url.url)
    client.set(KEY_PREFIX + key, client.get(KEY_PREFIX + key)[:-2])  # truncated
    assert tier.get(key) is None and client.get(KEY_PREFIX + key) is None and tier.corrupt == 1
    redis_url.proc.kill()
    redis_url.proc.wait()
    tier.put(key, b"payload")  # no exception: counted, logged
    assert tier.get(key) is None and tier.errors >= 2
    tier.close()


def test_an_mla_model_with_an_int8_cache_tiers_its_values_and_scales(model_factory):
    """DeepSeek-V3's latent cache (one plane) in int8 with scales: blocks evicted to host memory
    and loaded back give the outputs the first, fully computed run gave."""
    llm = LLM(str(model_factory("deepseek_v3")), kv_cache_memory=1 << 20, max_model_len=256,
              kv_cache_dtype="int8", kv_offload_cpu_bytes=8 << 20)
    try:
        batch = prompts(10, 2, 100)
        first = run(llm, batch)
        assert llm.reset_prefix_cache() > 0
        again = run(llm, batch)
        assert all(o.num_cached_tokens == 96 for o in again)
        assert llm.engine.core.kv_store.stats.hits["cpu"] == 12
        assert_same(again, first)
    finally:
        llm.shutdown()


def test_lora_namespaces_carry_over_to_the_tiers(llama_dir, lora_adapters):
    """A block an adapter computed comes back for that adapter only: the base model and
    another adapter miss in the tier, the same adapter hits with its own outputs."""
    from pagoda import LoRARequest

    llm = LLM(str(llama_dir), **KV, enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_offload_cpu_bytes=16 << 20)
    try:
        attn = LoRARequest("attn8", 1, str(lora_adapters["attn8"]))
        mlp = LoRARequest("mlp16rs", 2, str(lora_adapters["mlp16rs"]))
        batch = prompts(11, 1, 100)

        def go(lora):
            return llm.generate([{"prompt_token_ids": batch[0]}], PARAMS, use_tqdm=False, lora_request=lora)

        first = go(attn)
        llm.reset_prefix_cache()
        hits = llm.engine.core.kv_store.stats.hits["cpu"]
        assert go(None)[0].num_cached_tokens == 0 and go(mlp)[0].num_cached_tokens == 0
        assert llm.engine.core.kv_store.stats.hits["cpu"] == hits
        llm.reset_prefix_cache()
        again = go(attn)
        assert again[0].num_cached_tokens == 96
        assert_same(again, first)
    finally:
        llm.shutdown()
