"""The engine's parameter count (``ModelConfig.num_params``) is what the model holds: Hugging
Face's own sum over the same checkpoint, for dense, mixture-of-experts and MLA (DeepSeek-V3)
models; ``num_active_params`` leaves out the routed experts a token does not run."""
from __future__ import annotations

import pytest
import torch

from pagoda.bench.peers import weight_counts
from pagoda.config import ModelConfig

transformers = pytest.importorskip("transformers")

# The shared test checkpoints (tests/conftest.py), dense, mixture-of-experts and MLA.
SHARED = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
          "gemma2", "gemma3", "phi3", "olmo2", "glm4", "gpt_oss", "llama4"]
# Variants with the flags the shared ones leave at their defaults: MLA without a q low-rank
# projection and with attention biases (and other expert sizes); Llama with attention biases.
VARIANTS = {
    "deepseek_v3-no-q-lora-bias": ("deepseek_v3", dict(extra_config=dict(
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=20,
        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, attention_bias=True))),
    "llama-bias": ("llama", dict(extra_config=dict(attention_bias=True))),
}


def _checkpoint(model_factory, name: str):
    if name in VARIANTS:
        base, overrides = VARIANTS[name]
        return model_factory(base, **overrides)
    return model_factory(name)


def _hf_counts(path) -> tuple[int, int]:
    """(parameters, active parameters) of the Hugging Face model. DeepSeek's score-correction
    bias is a buffer there but a checkpoint tensor pagoda loads and reads, so it counts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())  # tied weights once
    total += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    cfg = model.config
    k = getattr(cfg, "num_experts_per_tok", 0)
    idle = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name or ".feed_forward.experts." in name:  # routed experts, stacked: (experts,
            # ...); a token runs k of them
            idle += p.numel() // p.shape[0] * (p.shape[0] - k)
    return total, total - idle


@pytest.mark.parametrize("name", SHARED + list(VARIANTS))
def test_num_params_matches_hugging_face(model_factory, name):
    path = _checkpoint(model_factory, name)
    total, active = _hf_counts(path)
    config = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    assert config.num_params == total
    assert config.num_active_params == active
    assert (active < total) == (name in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "llama4")
                                or name.startswith("deepseek"))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "qwen3"])
def test_roofline_bytes_count_active_parameters(model_factory, name):
    """The peers roofline reads, per decode token, every active parameter but the input embedding
    (the LM head reads the embedding table when they are tied)."""
    path = model_factory(name)
    config = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    counts = weight_counts(str(path))
    embedding = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embedding
    assert counts["head"] == embedding  # the LM head's rows, tied or not
    assert counts["body"] + counts["vectors"] == config.num_active_params - embedding - head
