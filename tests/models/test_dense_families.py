"""Gemma 2, Gemma 3 (text), Phi-3, OLMo 2 and GLM-4 against transformers on the same random
checkpoints (float32, CPU): prompt and decode logprobs, greedy generations (prompts longer than
the Gemma windows), the same through chunked prefill, small blocks, multi-step decode rounds, the
prefix cache and preemption; the options that must be real (soft-capping, windows, LongRoPE)
checked to matter."""
from __future__ import annotations

import json

import pytest
import torch

from pagoda import LLM
from pagoda.config import ModelConfig
from tests.models.parity_helpers import (LONG_PROMPTS, check_engine_paths, check_greedy, check_logprobs, greedy, hf_logprobs,
                                         hf_model)

FAMILIES = ["gemma2", "gemma3", "phi3", "olmo2", "glm4"]
PROMPTS = LONG_PROMPTS


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(model_factory, family):
    model_dir = model_factory(family)
    hf = hf_model(model_dir)
    # Chunks that start inside and past a window, over 4-token blocks, among the engine paths.
    check_engine_paths(model_dir, hf, PROMPTS)


def test_gemma_layer_windows_and_rope_bases(model_factory):
    gemma2 = ModelConfig.from_pretrained(str(model_factory("gemma2")), None, "float32", 256, "cpu")
    assert gemma2.sliding_windows == (16, None)
    gemma3_dir = model_factory("gemma3")
    gemma3 = ModelConfig.from_pretrained(str(gemma3_dir), None, "float32", 256, "cpu")
    assert gemma3.sliding_windows == (16, None, 16)
    llm = LLM(str(gemma3_dir), kv_cache_memory=8 << 20, max_model_len=256)
    assert llm.config.model.sliding_windows == (16, None, 16)


def test_gemma3_rope_bases_from_either_config_layout(model_factory, tmp_path):
    """Local and global layers rotate with their own bases and scaling, read from transformers'
    ``rope_parameters`` per layer type or from the older top-level keys."""
    from pagoda.models.gemma import layer_rope

    model_dir = model_factory("gemma3")
    cfg = ModelConfig.from_pretrained(str(model_dir), None, "float32", 256, "cpu")
    assert layer_rope(cfg, sliding=True) == (100.0, None)
    theta, scaling = layer_rope(cfg, sliding=False)
    assert theta == 1e6 and scaling["rope_type"] == "linear" and scaling["factor"] == 8.0
    old = json.loads((model_dir / "config.json").read_text())
    del old["rope_parameters"]
    old.update(rope_theta=1e6, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = ModelConfig.from_pretrained(str(tmp_path), str(model_dir), "float32", 256, "cpu")
    assert layer_rope(cfg, sliding=True) == (100.0, None)
    assert layer_rope(cfg, sliding=False) == (1e6, {"rope_type": "linear", "factor": 8.0})


def _hf_changed(model_dir, tmp_path, **changes):
    """transformers' model of ``model_dir`` with config keys changed (same weights)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in model_dir.iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    (changed / "config.json").write_text(json.dumps(cfg))
    return hf_model(changed)


@pytest.mark.parametrize("change", [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                                   dict(sliding_window=4096)])
def test_gemma2_options_change_the_reference(model_factory, tmp_path, change):
    """Each option the parity test covers moves transformers' logprobs far past its tolerance
    (so leaving one out of pagoda could not pass it)."""
    model_dir = model_factory("gemma2")
    ids = PROMPTS[0]
    diff = (hf_logprobs(hf_model(model_dir), ids) - hf_logprobs(_hf_changed(model_dir, tmp_path, **change), ids))
    assert diff.abs().max().item() > 1e-2


def test_phi3_longrope_matches_transformers(model_factory):
    """LongRoPE: with max_model_len past original_max_position_embeddings the long factors
    (and transformers uses them for sequences that long); with a shorter max_model_len the
    short ones. The two sets give different outputs."""
    short, long = [1.0, 1.3, 2.0, 3.5], [1.0, 2.5, 6.0, 11.0]
    model_dir = model_factory("phi3", max_position_embeddings=128, extra_config=dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=32,
        rope_scaling=dict(rope_type="longrope", short_factor=short, long_factor=long)))
    hf = hf_model(model_dir)
    # Longer than 32 from the first step: transformers picks the factors per forward call, so a
    # shorter prompt would have its prefill rotated with the short ones and its decode with the long.
    long_prompts = [list(range(30, 70)), list(range(100, 190, 2))]
    long_llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=128)
    check_logprobs(long_llm, hf, long_prompts, max_tokens=8)
    long_tokens = check_greedy(long_llm, hf, long_prompts, 12)
    short_llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=32)
    check_logprobs(short_llm, hf, [[5, 17, 42, 99, 7], list(range(200, 212))], max_tokens=8)
    assert greedy(short_llm, [p[:20] for p in long_prompts], 12) != greedy(long_llm, [p[:20] for p in long_prompts], 12)
    assert long_tokens


def test_softcap_needs_a_backend_that_implements_it(model_factory):
    from pagoda.models.gemma import GemmaForCausalLM

    class NoSoftcap:  # an attention backend without soft-capping (the Triton one, today)
        def forward(self, *args, **kwargs):
            raise AssertionError("never reached")

    cfg = ModelConfig.from_pretrained(str(model_factory("gemma2")), None, "float32", 256, "cpu")
    with pytest.raises(ValueError, match="soft-capping"):
        GemmaForCausalLM(cfg, NoSoftcap())


def test_bidirectional_gemma_is_refused(model_factory):
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.models.gemma import GemmaForCausalLM

    cfg = ModelConfig.from_pretrained(str(model_factory("gemma3")), None, "float32", 256, "cpu")
    cfg.hf_config["use_bidirectional_attention"] = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM(cfg, TorchAttentionBackend())


def test_unknown_architecture_is_refused_with_the_supported_list(model_factory, tmp_path):
    model_dir = model_factory("llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["FalconH1ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture") as info:
        ModelConfig.from_pretrained(str(tmp_path), None, "float32", None, "cpu")
    for name in ("FalconH1ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                 "Olmo2ForCausalLM", "Glm4ForCausalLM", "LlamaForCausalLM"):
        assert name in str(info.value)


def test_torch_backend_softcap_matches_explicit_attention():
    """The decode-group path (several sequences, a window) with soft-capping against the plain
    formula, so the test does not only rest on transformers."""
    from pagoda.layers.attention.backend import AttentionMetadata
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    lens = [9, 3]
    k_cache = torch.zeros(8, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.randn(n, kv_heads, dim) * 3 for n in lens]
    values = [torch.randn(n, kv_heads, dim) for n in lens]
    tables = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32)
    for b, n in enumerate(lens):  # all but the last token cached already
        for p in range(n - 1):
            blk, off = int(tables[b, p // block]), p % block
            k_cache[blk, off], v_cache[blk, off] = keys[b][p], values[b][p]
    slots = torch.tensor([int(tables[b, (n - 1) // block]) * block + (n - 1) % block for b, n in enumerate(lens)])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             context_lens=torch.tensor([n - 1 for n in lens], dtype=torch.int32),
                             block_tables=tables, max_query_len=1, max_seq_len=max(lens),
                             query_lens_cpu=[1, 1], seq_lens_cpu=lens)
    q = torch.randn(2, heads, dim) * 3
    new_k = torch.stack([k[-1] for k in keys])
    new_v = torch.stack([v[-1] for v in values])
    out = TorchAttentionBackend().forward(q, new_k, new_v, k_cache, v_cache, meta, 0.25, sliding_window=5,
                                          softcap=2.0)
    for b, n in enumerate(lens):
        lo = max(0, n - 5)
        k = keys[b][lo:].repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = values[b][lo:].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * 0.25
        probs = (torch.tanh(scores / 2.0) * 2.0).softmax(-1)
        torch.testing.assert_close(out[b], torch.einsum("hl,lhd->hd", probs, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fused_checkpoint_tensors_shard_by_rank(model_factory, monkeypatch, ranks):
    """Phi-3 stores q/k/v and gate/up fused: each tensor-parallel rank loads its own heads' rows
    of each part (4 ranks over 2 K/V heads: pairs of ranks share one)."""
    from tests.distributed.test_tp_loader import load_as_rank

    path = model_factory("phi3")
    cfg, full = load_as_rank(path, 0, 1, monkeypatch)
    d, inter = cfg.head_dim, cfg.intermediate_size
    q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
    full_qkv = full.model.layers[1].self_attn.qkv_proj.weight
    full_gate_up = full.model.layers[1].mlp.gate_up_proj.weight
    for rank in range(ranks):
        _, shard = load_as_rank(path, rank, ranks, monkeypatch)
        qkv = shard.model.layers[1].self_attn.qkv_proj
        q, kv = qkv.q_size, qkv.kv_size
        head = rank // qkv.kv_replicas
        expected = torch.cat([full_qkv[rank * q:(rank + 1) * q],
                              full_qkv[q_all + head * kv:q_all + (head + 1) * kv],
                              full_qkv[q_all + kv_all + head * kv:q_all + kv_all + (head + 1) * kv]])
        assert torch.equal(qkv.weight, expected)
        part = inter // ranks
        expected = torch.cat([full_gate_up[rank * part:(rank + 1) * part],
                              full_gate_up[inter + rank * part:inter + (rank + 1) * part]])
        assert torch.equal(shard.model.layers[1].mlp.gate_up_proj.weight, expected)
