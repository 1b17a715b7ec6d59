"""LoRA through the offline engine: each adapter against transformers + peft token for token,
mixed batches, the per-step adapter limit and slot eviction, the prefix cache's adapter keys."""
from __future__ import annotations

import shutil

import torch
from lora_helpers import MAX_TOKENS, PROMPTS

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.kvcache.radix_cache import RadixCache

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
FEED = [{"prompt_token_ids": p} for p in PROMPTS]
IDS = {"attn8": 1, "mlp16rs": 2, "qvdown16": 3}


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, IDS[name], str(adapters[name]))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def record_step_adapters(llm: LLM) -> list[set]:
    """The adapters (None: base) of every step the engine runs from now on."""
    steps: list[set] = []
    executor = llm.engine.core.executor
    run = executor.execute

    def execute(sched):
        steps.append({item.seq.request.lora_request for item in sched.scheduled})
        return run(sched)

    executor.execute = execute
    return steps


def test_each_adapter_matches_transformers_and_peft(lora_llm, lora_adapters, hf_outputs):
    base = tokens(lora_llm.generate(FEED, GREEDY, use_tqdm=False))
    assert base == hf_outputs[None]
    for name in lora_adapters:
        got = tokens(lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=lora(lora_adapters, name)))
        assert got == hf_outputs[name], name
        assert all(g != b for g, b in zip(got, base)), f"adapter {name} left some output unchanged"


def test_mixed_batch_gives_each_request_its_solo_output(lora_llm, lora_adapters, hf_outputs):
    names = [None, "attn8", "mlp16rs", "qvdown16"]
    feed = [FEED[i % len(FEED)] for i in range(8)]
    loras = [lora(lora_adapters, names[i % 4]) if names[i % 4] else None for i in range(8)]
    steps = record_step_adapters(lora_llm)
    try:
        got = tokens(lora_llm.generate(feed, GREEDY, use_tqdm=False, lora_request=loras))
    finally:
        del lora_llm.engine.core.executor.execute
    for i, out in enumerate(got):
        assert out == hf_outputs[names[i % 4]][i % len(FEED)], (i, names[i % 4])
    assert max(len(s) for s in steps) == 4  # three adapters and the base model in one step


def test_step_holds_at_most_max_loras_adapters_and_slots_are_reused(llama_dir, lora_adapters, hf_outputs):
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=512, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=2)
    try:
        steps = record_step_adapters(llm)
        names = ["attn8", "mlp16rs", "qvdown16", "attn8", None, "qvdown16"]
        feed = [FEED[i % len(FEED)] for i in range(len(names))]
        loras = [lora(lora_adapters, n) if n else None for n in names]
        got = tokens(llm.generate(feed, GREEDY, use_tqdm=False, lora_request=loras))
        for i, (name, out) in enumerate(zip(names, got)):
            assert out == hf_outputs[name][i % len(FEED)], (i, name)
        assert max(len(s - {None}) for s in steps) == 2
        manager = llm.engine.core.executor.lora
        assert len(manager.cache) <= 2 and len(manager.slot_of) <= 2  # LRU: three adapters, two places
    finally:
        llm.shutdown()


def test_prefix_cache_never_shares_kv_between_adapters(lora_llm, lora_adapters, hf_outputs, monkeypatch):
    prompt = [{"prompt_token_ids": PROMPTS[1]}]  # 37 tokens: two full blocks to share
    a, b = lora(lora_adapters, "attn8"), lora(lora_adapters, "qvdown16")
    lora_llm.reset_prefix_cache()
    first = lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    other = lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
    again = lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert other.num_cached_tokens == 0  # same tokens, another adapter: nothing reused
    assert again.num_cached_tokens == 32  # same adapter: its own two blocks
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_outputs["attn8"][1]
    assert other.outputs[0].token_ids == hf_outputs["qvdown16"][1]

    # The same runs with the adapter left out of the cache key reuse the other adapter's KV
    # and go wrong: the separation is what keeps the outputs right.
    match, insert = RadixCache.match, RadixCache.insert
    monkeypatch.setattr(RadixCache, "match", lambda self, ids, namespace=None: match(self, ids))
    monkeypatch.setattr(RadixCache, "insert", lambda self, parent, key, block, namespace=None:
                        insert(self, parent, key, block))
    lora_llm.reset_prefix_cache()
    lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)
    shared = lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
    assert shared.num_cached_tokens == 32
    assert shared.outputs[0].token_ids != hf_outputs["qvdown16"][1]
    monkeypatch.undo()
    lora_llm.reset_prefix_cache()


def test_bin_weights_load_like_safetensors(lora_llm, lora_adapters, hf_outputs, tmp_path):
    from safetensors.torch import load_file

    src = lora_adapters["mlp16rs"]
    shutil.copy(src / "adapter_config.json", tmp_path / "adapter_config.json")
    torch.save(load_file(str(src / "adapter_model.safetensors")), tmp_path / "adapter_model.bin")
    got = lora_llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=LoRARequest("bin", 9, str(tmp_path)))
    assert tokens(got) == hf_outputs["mlp16rs"]


def test_unused_adapter_is_removed_and_one_in_use_finishes_first(lora_llm, lora_adapters, hf_outputs):
    core = lora_llm.engine.core
    a = LoRARequest("late", 11, str(lora_adapters["attn8"]))
    lora_llm.engine.add_request("r-late", FEED[0], GREEDY, a)
    assert core.remove_lora(11)
    assert 11 in core.loras  # its request is still running: removal waits for it
    outs = []
    while lora_llm.engine.has_unfinished_requests():
        outs.extend(o for o in lora_llm.engine.step() if o.finished)
    assert outs[0].outputs[0].token_ids == hf_outputs["attn8"][0]
    assert 11 not in core.loras and 11 not in core.executor.lora.cache
    assert not core.remove_lora(11)


def test_ngram_speculation_and_chunked_prefill_keep_adapter_outputs(llama_dir, lora_adapters, hf_outputs):
    """Drafts are verified with the adapter; prompt chunks (16-token budget) run with it."""
    llm = LLM(str(llama_dir), kv_cache_memory=16 << 20, max_model_len=512, enable_lora=True, max_loras=2,
              max_num_batched_tokens=16, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        names = ["qvdown16", "mlp16rs", None]
        loras = [lora(lora_adapters, n) if n else None for n in names]
        got = tokens(llm.generate(FEED, GREEDY, use_tqdm=False, lora_request=loras))
        assert got == [hf_outputs[n][i] for i, n in enumerate(names)]
        assert llm.engine.core.proposer.num_proposed > 0
    finally:
        llm.shutdown()


def test_lora_stats_count_requests_not_samples(lora_llm, lora_adapters):
    """A request with n=3 is one request of its adapter, running or waiting, not three."""
    engine = lora_llm.engine
    params = {"n3": SamplingParams(temperature=0.8, n=3, max_tokens=4, ignore_eos=True, seed=1),
              "n1": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)}
    engine.add_request("stats-a", {"prompt_token_ids": PROMPTS[0]}, params["n3"], lora(lora_adapters, "attn8"))
    engine.add_request("stats-b", {"prompt_token_ids": PROMPTS[1]}, params["n1"], lora(lora_adapters, "mlp16rs"))
    engine.add_request("stats-c", {"prompt_token_ids": PROMPTS[2]}, params["n3"], None)
    waiting = engine.core.stats()
    assert waiting.waiting_lora_adapters == {"attn8": 1, "mlp16rs": 1} and waiting.running_lora_adapters == {}
    forked = None
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.core.scheduler.running
        if sum(seq.request.request_id == "stats-a" for seq in running) == 3:
            forked = engine.core.stats()
            break
    assert forked is not None  # the n=3 request's samples ran side by side
    assert forked.running_lora_adapters == {"attn8": 1, "mlp16rs": 1}
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.core.stats()
    assert done.running_lora_adapters == {} and done.waiting_lora_adapters == {}
