"""Llama 4 text against transformers on random checkpoints (float32, CPU): prompt and decode
logprobs and greedy tokens with prompts past the 8-token attention chunks, the same through
chunked prefill, small blocks, multi-step decode rounds, the prefix cache and preemption; two
experts per token; the options that must be real (chunking, temperature tuning, the q/k norm)
checked to matter; a multimodal (Llama4ForConditionalGeneration) checkpoint loaded text-only."""
from __future__ import annotations

import json
import shutil

import pytest

from pagoda import LLM
from pagoda.config import ModelConfig
from tests.models.parity_helpers import LONG_PROMPTS, check_engine_paths, check_greedy, check_logprobs, hf_logprobs, hf_model

PROMPTS = LONG_PROMPTS


@pytest.fixture(scope="module")
def llama4(model_factory):
    model_dir = model_factory("llama4")
    return model_dir, hf_model(model_dir)


def test_llama4_matches_transformers(llama4):
    model_dir, hf = llama4
    check_engine_paths(model_dir, hf, PROMPTS)


def test_llama4_two_experts_per_token(model_factory):
    """With top-2 routing each kept expert runs on its own scaled copy of the input."""
    spec = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size_mlp=96, interleave_moe_layer_step=2,
                no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5)
    model_dir = model_factory("llama4", num_layers=2, extra_config=spec)
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=128)
    check_logprobs(llm, hf_model(model_dir), PROMPTS[:2], max_tokens=8)


def _hf_changed(model_dir, tmp_path, **changes):
    changed = tmp_path / "changed"
    shutil.copytree(model_dir, changed)
    cfg = json.loads((changed / "config.json").read_text())
    cfg.update(changes)
    (changed / "config.json").write_text(json.dumps(cfg))
    return hf_model(changed)


@pytest.mark.parametrize("change", [dict(attention_chunk_size=4096), dict(attn_temperature_tuning=False),
                                   dict(use_qk_norm=False)])
def test_llama4_options_change_the_reference(llama4, tmp_path, change):
    model_dir, hf = llama4
    ids = PROMPTS[0]
    diff = hf_logprobs(hf, ids) - hf_logprobs(_hf_changed(model_dir, tmp_path, **change), ids)
    assert diff.abs().max().item() > 1e-2


def test_llama4_layer_kinds(llama4):
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.models.llama4 import Llama4ForCausalLM, Llama4MoE

    model_dir, _ = llama4
    cfg = ModelConfig.from_pretrained(str(model_dir), None, "float32", 64, "cpu")
    model = Llama4ForCausalLM(cfg, TorchAttentionBackend())
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.use_rope for a in attn] == [True, False, True, False]
    assert [a.chunk_size for a in attn] == [8, None, 8, None]
    assert [a.temperature is not None for a in attn] == [False, True, False, True]
    assert [isinstance(layer.mlp, Llama4MoE) for layer in model.model.layers] == [False, True, False, True]
    assert attn[0].rotary is attn[2].rotary  # one RoPE table, max_model_len long
    assert attn[0].rotary.cos_sin_cache.shape[0] == 64


def test_multimodal_checkpoint_loads_text_only(llama4, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (made by transformers, with a vision tower):
    its language model under ``language_model.`` serves the same tokens as the text model."""
    from transformers import AutoConfig, Llama4Config, Llama4ForConditionalGeneration, Llama4VisionConfig

    model_dir, hf = llama4
    vision = Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32,
                                projector_output_dim=32)
    text = AutoConfig.from_pretrained(str(model_dir))
    multimodal = Llama4ForConditionalGeneration(Llama4Config(text_config=text.to_dict(),
                                                             vision_config=vision.to_dict()))
    multimodal.language_model.load_state_dict(hf.state_dict())
    out = tmp_path / "multimodal"
    multimodal.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]
    llm = LLM(str(out), kv_cache_memory=8 << 20, max_model_len=128)
    assert llm.config.model.num_layers == 4
    check_greedy(llm, hf, PROMPTS[:2], 12)
