"""Tests for pagoda's random-weight checkpoint maker (`pagoda make-model`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda.tools import make_model as mm

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "Numbers 12345 and 3.14159; punctuation: (a, b) -> [c] {d}!?",
    "line one\nline two\n\n\ttabbed line",
    "It's a test -- we'll see what they've done.",
]


def _load(model_dir: Path) -> torch.nn.Module:
    """Load with transformers and insist every checkpoint tensor was used and none was missing."""
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("arch", sorted(ARCH_CLASSES))
def test_each_arch_loads_with_transformers(tmp_path: Path, arch: str) -> None:
    out = mm.make_model(tmp_path / arch, arch=arch, num_kv_heads=2)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCH_CLASSES[arch]]
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    model = _load(out)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert model.config.num_key_value_heads == 2

    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    # Whatever tokenizer class transformers picks must agree with the raw tokenizer.json.
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == raw.encode(text).ids
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_sharded_checkpoint_has_index_and_matches_unsharded(tmp_path: Path) -> None:
    whole = mm.make_model(tmp_path / "whole", seed=3)
    sharded = mm.make_model(tmp_path / "sharded", seed=3, max_shard_size="200KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    a, b = mm.read_checkpoint(whole), mm.read_checkpoint(sharded)
    assert set(a) == set(b) == set(index["weight_map"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    _load(sharded)


def test_qwen2_attention_biases_are_random(tmp_path: Path) -> None:
    tensors = mm.read_checkpoint(mm.make_model(tmp_path / "q2", arch="qwen2"))
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = tensors[f"model.layers.{layer}.self_attn.{proj}.bias"]
            assert bias.abs().mean() > 0.05 and bias.std() > 0.05
        assert f"model.layers.{layer}.self_attn.o_proj.bias" not in tensors


def test_qwen3_has_randomized_qk_norms(tmp_path: Path) -> None:
    tensors = mm.read_checkpoint(mm.make_model(tmp_path / "q3", arch="qwen3", head_dim=32))
    for name in ("q_norm", "k_norm"):
        weight = tensors[f"model.layers.0.self_attn.{name}.weight"]
        assert weight.shape == (32,)
        assert not torch.allclose(weight, torch.ones_like(weight), atol=1e-2)
    # Every RMSNorm is perturbed, so a loader that skips one produces different outputs.
    final_norm = tensors["model.norm.weight"]
    assert (final_norm - 1).abs().max() > 0.05


def test_head_dim_override(tmp_path: Path) -> None:
    out = mm.make_model(tmp_path / "hd", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    tensors = mm.read_checkpoint(out)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 32)
    with torch.no_grad():
        _load(out)(torch.tensor([[7, 8, 9]]))


def test_tie_embeddings(tmp_path: Path) -> None:
    out = mm.make_model(tmp_path / "tied", tie_embeddings=True)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in mm.read_checkpoint(out)
    model = _load(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    untied = mm.read_checkpoint(mm.make_model(tmp_path / "untied"))
    assert "lm_head.weight" in untied


def test_rope_scaling_and_dtype_pass_through(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    out = mm.make_model(tmp_path / "rope", rope_scaling=scaling, rope_theta=500000.0,
                        dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == scaling and config["rope_theta"] == 500000.0
    assert config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in mm.read_checkpoint(out).values())
    model = _load(out)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["rope_theta"] == 500000.0


def test_chat_template(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(mm.make_model(tmp_path / "chat"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt.endswith("Hi there<|im_end|>\n")
    ids = tok.encode(text)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 3 and ids.count(end) == 2  # each marker is one special token


def test_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(mm.make_model(tmp_path / "rt"))
    assert len(tok) == 512
    for text in TEXTS + ["café naïve résumé ✓ 日本語"]:
        ids = tok.encode(text)
        assert tok.bos_token_id not in ids  # no implicit BOS: decode(encode(s)) == s
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXTS[0])) < 0.8 * len(TEXTS[0].encode())  # merges learned, not bytes


def test_same_seed_is_deterministic(tmp_path: Path) -> None:
    a = mm.make_model(tmp_path / "a", arch="qwen2", seed=7)
    b = mm.make_model(tmp_path / "b", arch="qwen2", seed=7)
    c = mm.make_model(tmp_path / "c", arch="qwen2", seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ta, tc = mm.read_checkpoint(a), mm.read_checkpoint(c)
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])


def test_greedy_margins_and_diversity(tmp_path: Path) -> None:
    out = mm.make_model(tmp_path / "margin", arch="qwen3")
    model = _load(out)
    tok = AutoTokenizer.from_pretrained(out)
    gaps: list[float] = []
    for prompt in ("The quick brown fox", "def main():\n    return", "Hello, my name is"):
        tokens, step_gaps = mm.hf_greedy(model, tok.encode(prompt), 48)
        gaps += step_gaps
        assert len(set(tokens)) >= 10, tokens  # not stuck repeating a token or two
        assert all(t >= len(mm.SPECIAL_TOKENS) for t in tokens)  # no spontaneous EOS
    assert sum(g < 1e-3 for g in gaps) / len(gaps) < 0.02
    assert sorted(gaps)[len(gaps) // 2] > 0.1


def test_cli_main_and_add_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    assert mm.main(["--arch", "mistral", "--out", str(out), "--hidden-size", "32",
                    "--num-layers", "1", "--num-heads", "2", "--vocab-size", "300",
                    "--tie-embeddings", "--seed", "5"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (32, 1, 300)
    assert config["tie_word_embeddings"] is True

    parser = argparse.ArgumentParser(prog="pagoda")
    mm.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", "--out", str(tmp_path / "sub"), "--arch", "qwen3",
                              "--max-shard-size", "100KB"])
    assert args.func(args) == 0
    assert (tmp_path / "sub" / "model.safetensors.index.json").is_file()


def test_demo_model_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    path = mm.demo_model_path()
    assert path.parent == tmp_path / "cache" and path.name.startswith("demo-model-")
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert mm.demo_model_path() == path
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        mm.make_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError):
        mm.make_model(tmp_path / "x", vocab_size=100)
    with pytest.raises(ValueError):
        mm.make_model(tmp_path / "x", dtype="int8")
