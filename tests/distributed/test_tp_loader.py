"""Each rank loads only its slice of the weights: about 1/N of the model, plus what must be
replicated (norms, and K/V heads when there are fewer of them than ranks)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.config import ModelConfig
from pagoda.distributed import parallel_state
from pagoda.distributed.parallel_state import TPGroup
from pagoda.layers.attention.torch_backend import TorchAttentionBackend
from pagoda.models.decoder import DecoderForCausalLM
from pagoda.models.loader import load_model


def load_as_rank(path: Path, rank: int, size: int,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[ModelConfig, DecoderForCausalLM]:
    """Build and load the model as rank ``rank`` of ``size`` would (loading needs no collectives)."""
    cfg = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "_TP", TPGroup(rank, size))
        return cfg, load_model(cfg, TorchAttentionBackend(), "cpu")


def num_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once


def expected_elements(m: ModelConfig, n: int) -> int:
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_heads // n * d, max(m.num_kv_heads // n, 1) * d  # a K/V head is never split
    qkv = (q + 2 * kv) * (h + int(m.qkv_bias))
    o = q * h + (h if m.o_bias else 0)  # the o_proj bias is added after the all-reduce: replicated
    mlp = 3 * (m.intermediate_size // n) * h
    norms = 2 * h + (2 * d if m.qk_norm else 0)
    vocab = -(-m.vocab_size // n) * h * (1 if m.tie_word_embeddings else 2)  # rows padded to equal slices
    return m.num_layers * (qkv + o + mlp + norms) + vocab + h


CASES = {
    "llama-kv2-tp2": (dict(name="llama"), 2),
    "llama-kv2-tp4-kv-replicated": (dict(name="llama"), 4),
    "qwen2-kv1-tied-vocab509-tp2": (dict(name="qwen2", num_kv_heads=1, vocab_size=509, tie_embeddings=True), 2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_rank_holds_its_share(model_factory, monkeypatch, case):
    spec, n = case
    path = model_factory(**spec)
    cfg, full = load_as_rank(path, 0, 1, monkeypatch)
    full_bytes = num_bytes(full)
    for rank in range(n):
        _, shard = load_as_rank(path, rank, n, monkeypatch)
        got = num_bytes(shard)
        assert got == expected_elements(cfg, n) * 4
        assert got < full_bytes / n * 1.25  # the replicated parts are small
    if cfg.num_kv_heads >= n:
        assert got == pytest.approx(full_bytes / n, rel=0.01)


def test_replicated_kv_heads_are_the_right_heads(model_factory, monkeypatch):
    path = model_factory("llama")  # 2 K/V heads on 4 ranks: ranks 0,1 hold head 0; ranks 2,3 head 1
    cfg, full = load_as_rank(path, 0, 1, monkeypatch)
    d, q_full = cfg.head_dim, cfg.num_heads * cfg.head_dim
    full_k = full.model.layers[0].self_attn.qkv_proj.weight[q_full:q_full + cfg.num_kv_heads * d]
    for rank in range(4):
        _, shard = load_as_rank(path, rank, 4, monkeypatch)
        qkv = shard.model.layers[0].self_attn.qkv_proj
        head = rank // 2
        assert torch.equal(qkv.weight[qkv.q_size:qkv.q_size + d], full_k[head * d:(head + 1) * d])
