"""Granite 4 hybrids and Bamba (Mamba-2 layers beside attention) against transformers on random float32
checkpoints of several shapes and layer patterns: prompt and decode logprobs, greedy tokens for a
batch of different lengths, the same through chunked prefill (chunks that cut the Mamba scan's
own chunks), preemption, ``n > 1`` forks (the recurrent state copied), with the prefix-caching
flag on; and the options hybrids refuse."""
from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, EngineConfig
from tests.models.granite_hybrid_helpers import make_bamba, make_granite_hybrid
from tests.models.parity_helpers import check_greedy, check_logprobs, greedy, hf_model

# 40, 5, 1 (a one-token prompt decodes from a fresh state), 30 and 23 tokens.
PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 7], [11], list(range(100, 190, 3)), list(range(200, 223))]

SHAPES = {
    # MoE + shared MLP, RoPE, every multiplier away from 1, two groups of B/C.
    "moe_rope": dict(layer_types=["mamba", "attention", "mamba"], embedding_multiplier=1.5,
                     residual_multiplier=0.7, logits_scaling=1.3),
    # Dense (shared MLP only), no position encoding, attention first, one group, scan chunks of 4.
    "dense_nope": dict(layer_types=["attention", "mamba", "mamba", "attention"], experts=0, rope=False, groups=1,
                       mamba_heads=8, chunk=4, seed=1),
    # Wider, a larger state, more KV heads than one.
    # Granite 4.0's attention-only members share the architecture name: no state, prefix reuse.
    "attention_only": dict(layer_types=["attention", "attention"], experts=0, seed=3),
    "wide": dict(layer_types=["mamba", "mamba", "attention", "mamba"], hidden=48, heads=6, kv_heads=3,
                 mamba_heads=6, d_state=16, groups=3, chunk=16, seed=2),
}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    made: dict = {}

    def get(name: str):
        if name not in made:
            made[name] = make_granite_hybrid(tmp_path_factory.mktemp(name), **SHAPES[name])
        return made[name]

    return get


@pytest.mark.parametrize("shape", ["moe_rope", "dense_nope", "wide"])
def test_matches_transformers(granite, shape):
    model_dir = granite(shape)
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    assert llm.config.cache.enable_prefix_caching is False  # asked for (the default), off for hybrids
    check_logprobs(llm, hf, PROMPTS[:2], max_tokens=10)
    full = check_greedy(llm, hf, PROMPTS, 16)
    assert greedy(llm, PROMPTS, 16) == full  # the same prompts again: slots reused, nothing stale
    # Chunks of 7 prompt tokens (cutting the scan's chunks of 4/8/16), 4-token blocks, a step
    # budget that mixes chunks of several prompts with decodes; multi-step rounds asked for.
    chunked = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256, long_prefill_token_threshold=7,
                  max_num_batched_tokens=16, block_size=4, num_scheduler_steps=4)
    assert greedy(chunked, PROMPTS, 16) == full


def test_attention_only_member_keeps_prefix_caching(granite):
    model_dir = granite("attention_only")
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256, block_size=4)
    assert llm.config.cache.enable_prefix_caching and llm.engine.core.kv.states is None
    full = check_greedy(llm, hf, PROMPTS[:2], 12)
    assert greedy(llm, PROMPTS[:2], 12) == full
    assert llm.engine.core.kv.stats.hits > 0


def test_preemption_restarts_the_state(granite):
    model_dir = granite("moe_rope")
    roomy = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=96, block_size=4, max_num_seqs=8)
    full = greedy(roomy, PROMPTS, 20)
    assert roomy.engine.core.scheduler.num_preemptions == 0
    runner = roomy.engine.core.executor
    # Room for 24 blocks of 4 tokens beside the state pool: fewer than the prompts need together.
    budget = runner.state_bytes() + 24 * runner.kv_bytes_per_block()
    tight = LLM(str(model_dir), kv_cache_memory=budget, max_model_len=96, block_size=4, max_num_seqs=8)
    assert tight.engine.core.kv.num_blocks == 24
    assert greedy(tight, PROMPTS, 20) == full
    assert tight.engine.core.scheduler.num_preemptions > 0
    # Forked samples preempted and recomputed (from their own tokens, a fresh state) too.
    before = tight.engine.core.scheduler.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True)
    outs = tight.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [[o.token_ids for o in out.outputs] for out in outs] == [[f, f] for f in full]
    assert tight.engine.core.scheduler.num_preemptions > before
    states = tight.engine.core.kv.states
    assert states.num_free == states.num_slots


def test_n_samples_fork_the_state(granite):
    """Each of n samples continues from a copy of the prompt's state: greedy samples all equal
    transformers' greedy tokens (a sample without the copy would start from an empty slot)."""
    model_dir = granite("dense_nope")
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    ref = check_greedy(llm, hf, PROMPTS[:2], 12)
    for out, tokens in zip(outs, ref):
        assert [o.token_ids for o in out.outputs] == [tokens] * 3
    # Sampled (seeded) samples differ from one another, and the engine is left consistent.
    sampled = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=1.0, max_tokens=12, n=3,
                                                                              seed=7, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    core = llm.engine.core
    assert core.kv.states is not None and core.kv.states.num_free == core.kv.states.num_slots


@pytest.mark.parametrize("option, value, named", [
    ("speculative_config", '{"method": "ngram", "num_speculative_tokens": 2}', "speculative decoding"),
    ("tensor_parallel_size", 2, "tensor parallelism"),
    ("enable_lora", True, "LoRA"),
])
def test_refused_options(granite, option, value, named):
    with pytest.raises(ValueError, match=f"hybrid model.*{named}"):
        EngineConfig.from_args(EngineArgs(model=str(granite("moe_rope")), **{option: value}))


@pytest.mark.parametrize("shape", ["moe_rope", "dense_nope"])
def test_param_counts_match_transformers(granite, shape):
    from transformers import AutoModelForCausalLM

    from pagoda.config import ModelConfig

    path = granite(shape)
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    total = sum(p.numel() for p in hf.parameters())
    cfg = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    assert cfg.num_params == total
    experts = hf.config.num_local_experts
    idle = sum(p.numel() // experts * (experts - hf.config.num_experts_per_tok)
               for n, p in hf.named_parameters() if ".experts." in n) if experts else 0
    assert cfg.num_active_params == total - idle


def test_memory_profile_step_and_state_budget(granite):
    """The GPU memory profile's dummy step runs a hybrid (each dummy sequence gets a slot), and
    on CPU the state pool comes out of ``kv_cache_memory`` before the blocks."""
    from pagoda.executor.gpu_profile import _dummy_step, _temporary_kv_cache
    from pagoda.executor.model_runner import ModelRunner

    args = EngineArgs(model=str(granite("wide")), device="cpu", max_model_len=256, max_num_batched_tokens=300,
                      max_num_seqs=7, kv_cache_memory=4 << 20)
    runner = ModelRunner(EngineConfig.from_args(args))
    mixer = runner.state_layers[0]
    assert len(runner.state_layers) == 3 and runner.num_state_slots == 7
    assert runner.determine_num_blocks() == ((4 << 20) - runner.state_bytes()) // runner.kv_bytes_per_block()
    with pytest.raises(ValueError, match="recurrent-state pool of 7 sequences.*lower max_num_seqs"):
        ModelRunner(EngineConfig.from_args(args.replace(kv_cache_memory=runner.state_bytes()))).determine_num_blocks()
    with _temporary_kv_cache(runner):
        assert mixer.ssm_state.shape == (7, 6, 16, 16) and mixer.ssm_state.dtype.itemsize == 4
        _dummy_step(runner)


def test_sleep_drops_and_rebuilds_the_states(granite):
    """Sleep gives back the state pool with the KV cache (level 2: the weights too, whose new
    Mamba layers get a fresh pool on wake-up); outputs are unchanged afterwards."""
    llm = LLM(str(granite("dense_nope")), kv_cache_memory=8 << 20, max_model_len=256, enable_sleep_mode=True)
    core = llm.engine.core
    before = greedy(llm, PROMPTS, 12)
    for level in (1, 2):
        core.sleep(level)
        assert all(layer.ssm_state.numel() == 0 for layer in core.executor.state_layers)
        core.wake_up()
        mixers = core.executor.state_layers
        assert mixers[0] is core.executor.model.state_layers()[0]  # the live model's layers
        assert mixers[0].ssm_state.shape[0] == core.kv.states.num_slots
        assert greedy(llm, PROMPTS, 12) == before


def test_bamba_matches_transformers(tmp_path):
    """Bamba: the same mixer and state pool with dense MLPs, half-rotary attention at
    ``attn_layer_indices``; whole prompts and chunks of 5, and its parameter count."""
    from pagoda.config import ModelConfig

    model_dir = make_bamba(tmp_path / "bamba", attn_layer_indices=[1, 4], num_layers=5, groups=1, chunk=4, seed=4)
    hf = hf_model(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256)
    assert llm.engine.core.kv.states is not None and len(llm.engine.core.executor.state_layers) == 3
    check_logprobs(llm, hf, PROMPTS[:2], max_tokens=8)
    full = check_greedy(llm, hf, PROMPTS, 12)
    chunked = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256, long_prefill_token_threshold=5,
                  block_size=4)
    assert greedy(chunked, PROMPTS, 12) == full
    cfg = ModelConfig.from_pretrained(str(model_dir), None, "float32", None, "cpu")
    assert cfg.num_params == cfg.num_active_params == sum(p.numel() for p in hf.parameters())
