"""Random-weight Granite 4 hybrid checkpoints (``GraniteMoeHybridForCausalLM``) made by
transformers itself, with weights large enough that every part (Mamba state, experts, shared
MLP, multipliers) changes the greedy tokens."""
from __future__ import annotations

from pathlib import Path

import torch


def make_granite_hybrid(path: Path, *, layer_types: list[str], hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                        mamba_heads: int = 4, d_state: int = 8, groups: int = 2, chunk: int = 8, experts: int = 4,
                        rope: bool = True, seed: int = 0, **extra) -> Path:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from pagoda.tools.make_model import build_tokenizer

    cfg = GraniteMoeHybridConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=24, shared_intermediate_size=40,
        num_hidden_layers=len(layer_types), num_attention_heads=heads, num_key_value_heads=kv_heads,
        layer_types=layer_types, mamba_n_heads=mamba_heads, mamba_d_state=d_state,
        mamba_d_head=2 * hidden // mamba_heads, mamba_n_groups=groups, mamba_chunk_size=chunk,
        num_local_experts=experts, num_experts_per_tok=2 if experts else 0,
        position_embedding_type="rope" if rope else None, max_position_embeddings=512,
        attention_multiplier=float((hidden // heads) ** -0.5), eos_token_id=None, bos_token_id=None,
        **extra)
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(cfg).float().eval()
    _scale_weights(model)
    model.save_pretrained(str(path))
    build_tokenizer(cfg.vocab_size, cfg.max_position_embeddings).save_pretrained(str(path))
    return path


def _scale_weights(model) -> None:
    """Weights large enough to matter: matrices N(0, 1/fan_in), decay rates between e^-1 and e,
    norm scales near 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)  # decay rates exp(A_log) between e^-1 and e
            elif name.endswith(("dt_bias", ".D")):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.normal_(0.0, 0.1)


def make_bamba(path: Path, *, attn_layer_indices: list[int], num_layers: int, hidden: int = 32, heads: int = 4,
               kv_heads: int = 2, mamba_heads: int = 4, d_state: int = 8, groups: int = 2, chunk: int = 8,
               seed: int = 0) -> Path:
    """A random Bamba checkpoint (``BambaForCausalLM``), weights scaled as above."""
    from transformers import BambaConfig, BambaForCausalLM

    from pagoda.tools.make_model import build_tokenizer

    cfg = BambaConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=48, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attn_layer_indices=attn_layer_indices,
        mamba_n_heads=mamba_heads, mamba_d_state=d_state, mamba_d_head=2 * hidden // mamba_heads,
        mamba_n_groups=groups, mamba_chunk_size=chunk, max_position_embeddings=512, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = BambaForCausalLM(cfg).float().eval()
    _scale_weights(model)
    model.save_pretrained(str(path))
    build_tokenizer(cfg.vocab_size, cfg.max_position_embeddings).save_pretrained(str(path))
    return path
