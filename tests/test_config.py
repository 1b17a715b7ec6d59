"""``EngineConfig.from_args``: each flag group's refusal names the flag, and the values derived
from the flags (step budget, steps per round, encoder budget, LoRA slots, sequence cap) land in
the configs the engine is built from. No weights load: only config.json is read."""
from __future__ import annotations

import pytest

from pagoda.config import CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, EngineArgs, EngineConfig


@pytest.mark.parametrize("changes, message", [
    (dict(load_format="x"), "load_format must be auto or dummy"),
    (dict(max_logprobs=-2), "max_logprobs must be non-negative"),
    (dict(structured_outputs_backend="x"), "structured_outputs_backend must be"),
    (dict(block_size=0), "block_size must be at least 1"),
    (dict(block_size=48), "block_size must be a power of two"),
    (dict(eviction_policy="x"), "eviction_policy must be lru or lfu"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(mm_encoder_cache_bytes=-1), "mm_encoder_cache_bytes must be a non-negative integer"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens must be at least 1"),
    (dict(scheduling_policy="x"), "scheduling_policy must be fcfs, lpm or priority"),
    (dict(max_queue_time=0), "max_queue_time must be a positive number"),
    (dict(max_request_output_tokens=1.5), "max_request_output_tokens must be a positive integer"),
    (dict(num_scheduler_steps=0), "num_scheduler_steps must be an integer of at least 1"),
    (dict(async_scheduling=True, num_scheduler_steps=3), "async_scheduling runs one decode step per round"),
    (dict(max_num_encoder_tokens_per_step=0), "max_num_encoder_tokens_per_step must be a positive integer"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be at least 1"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not divide the model.s 4 attention heads"),
    (dict(task="embed", tensor_parallel_size=2), "embedding models run with tensor_parallel_size"),
    (dict(pipeline_parallel_size=3), "more stages than the model's 2 decoder layers"),
    (dict(enable_expert_parallel=True), "needs a mixture-of-experts model"),
    (dict(nnodes=2, tensor_parallel_size=2), "nnodes > 1 needs dist_init_addr"),
    (dict(max_model_len=0), "max_model_len must be a positive integer, got 0"),
    (dict(max_model_len="64"), "max_model_len must be a positive integer, got '64'"),
])
def test_a_bad_flag_is_refused_by_name(llama_dir, changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", **changes))


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineConfig.from_args(EngineArgs(model=str(tmp_path / "nope"), device="cpu"))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(num_attention_heads="4"), "num_attention_heads must be a positive integer, got '4'"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (lambda c: c.pop("vocab_size"), "has no vocab_size"),
    (lambda c: c.update(head_dim=-8), "head_dim must be a positive integer"),
    (lambda c: c.update(rope_theta=None), "rope_theta must be a number, got None"),
    (None, "is not valid JSON"),
])
def test_a_bad_config_json_is_named_with_its_key(llama_dir, tmp_path, edit, message):
    """A config.json the model cannot be built from fails naming the file and the key, not with
    a KeyError or a division by zero further in."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    if edit is None:
        (bad / "config.json").write_text("{not json")
    else:
        cfg = json.loads((bad / "config.json").read_text())
        edit(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json.*" + message):
        EngineConfig.from_args(EngineArgs(model=str(bad), device="cpu"))


def test_a_weights_file_given_as_the_model_is_named(llama_dir):
    with pytest.raises(FileNotFoundError, match="is a file: give its directory"):
        EngineConfig.from_args(EngineArgs(model=str(llama_dir / "model.safetensors"), device="cpu"))


def test_derived_values_reach_their_configs(llama_dir):
    plain = EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu"))
    assert plain.scheduler.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
    assert plain.scheduler.max_num_seqs == CPU_MAX_NUM_SEQS
    assert plain.scheduler.max_num_encoder_tokens_per_step == CPU_MAX_NUM_BATCHED_TOKENS
    assert plain.scheduler.fair_step_share and plain.scheduler.max_loras == 0
    assert plain.parallel.tensor_parallel_size == 1 and plain.parallel.nnodes == 1

    # Whole prompts only: the step budget grows to the longest legal prompt.
    whole = EngineConfig.from_args(EngineArgs(model=str(llama_dir), device="cpu", enable_chunked_prefill=False))
    assert whole.scheduler.max_num_batched_tokens == whole.model.max_model_len > CPU_MAX_NUM_BATCHED_TOKENS

    cfg = EngineConfig.from_args(EngineArgs(
        model=str(llama_dir), device="cpu", max_num_batched_tokens=96, max_num_seqs=3, async_scheduling=True,
        enable_lora=True, max_loras=2, block_size=32, eviction_policy="lfu", mm_encoder_cache_bytes=0,
        tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1234"))
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs) == (96, 3)
    assert cfg.scheduler.max_num_encoder_tokens_per_step == 96
    assert cfg.scheduler.num_scheduler_steps == 1 and cfg.scheduler.async_scheduling
    assert cfg.scheduler.max_loras == 2 and cfg.lora is not None and cfg.lora.max_cpu_loras == 2
    assert (cfg.cache.block_size, cfg.cache.eviction_policy, cfg.cache.mm_encoder_cache_bytes) == (32, "lfu", 0)
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.nnodes, cfg.parallel.node_rank) == (2, 2, 1)
    assert cfg.parallel.dist_init_addr == "127.0.0.1:1234"
