"""Real model shapes for the GPU benchmarks: weightless directories, and random bf16 checkpoints.

``make_model`` builds test checkpoints through transformers' model classes in fp32 and trains
a BPE tokenizer of the full vocabulary; for an 8B model that means 32 GB of host memory and
minutes of tokenizer training. Speed measurements need neither realistic weights nor a real
tokenizer, so this writer draws every tensor directly in bf16 (on the GPU when there is one),
writes safetensors shards with an index, and adds a word-level tokenizer with one token per id
(instant to build; it decodes any id the model can emit). Names and shapes come from
transformers' own model class instantiated on the meta device, so the checkpoint loads in
transformers and pagoda alike.

``bench_shape_dir`` writes the same directory without weights (config and tokenizer, a few MB):
pagoda loads it with ``load_format="dummy"`` (random weights made in place on the device) and
transformers with ``from_config``, so an 8B shape costs no 16 GB write or read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.tools import make_model as mm

WRITER_VERSION = "v1"
SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None = None


SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 131072, 500000.0,
                       {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 40960, 1000000.0),
}


def bench_shape_dir(name: str, shape: Shape | None = None) -> Path:
    """The cached weightless directory of shape ``name`` (``shape`` overrides the published one:
    the dry run's tiny shapes), written on first use."""
    shape = shape or SHAPES[name]
    final = mm.cache_dir() / f"bench-{name}-shape-{WRITER_VERSION}-{hashlib.sha1(repr(shape).encode()).hexdigest()[:8]}"
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    try:
        write_shape_dir(tmp, shape)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").exists():  # lost to something other than a racing writer
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_shape_dir(out: Path, shape: Shape) -> Any:
    """Write config (bf16), generation config and the word-level tokenizer to ``out``; returns
    the transformers config."""
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(shape)
    config.save_pretrained(out)
    mm._patch_config_json(out, shape.rope_theta, shape.rope_scaling, "bfloat16")
    _generation_config(config).save_pretrained(out)
    _tokenizer(shape.vocab_size).save_pretrained(out)
    return config


def write_random_model(out: Path, shape: Shape, device: torch.device, seed: int = 0,
                       shard_bytes: int = SHARD_BYTES) -> Path:
    """Write config, bf16 random weights (sharded) and a word-level tokenizer to ``out``."""
    config = write_shape_dir(out, shape)
    _write_weights(out, _tensor_shapes(config), device, seed, shard_bytes)
    return out


def _hf_config(shape: Shape) -> Any:
    config = mm.build_config(shape.arch, shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
                             shape.head_dim, shape.intermediate_size, shape.vocab_size, shape.tie_embeddings,
                             shape.max_position_embeddings, shape.rope_theta, shape.rope_scaling)
    config.architectures = [mm.ARCHS[shape.arch][1]]  # what loaders dispatch on
    return config


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=config.pad_token_id)


def _tokenizer(vocab_size: int) -> Any:
    """One word per id: ``t<id>``, with make_model's special tokens at the bottom."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(mm.SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(mm.SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=mm.UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=mm.UNK, bos_token=mm.BOS, eos_token=mm.EOS,
                                   pad_token=mm.PAD, additional_special_tokens=[mm.IM_START, mm.IM_END])


def _tensor_shapes(config: Any) -> dict[str, torch.Size]:
    """Checkpoint tensor names and shapes, from transformers' model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # stored once, as the embedding
    return shapes


def _shards(shapes: dict[str, torch.Size], shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most ``shard_bytes`` (bf16), in checkpoint order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * shape.numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if len(shape) == 1:  # norm weights (and biases): ones keep activations in range
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    # Projections at 1/sqrt(fan_in) keep each layer's output O(1); embeddings small, as trained ones are.
    std = 0.02 if "embed_tokens" in name or "lm_head" in name else shape[-1] ** -0.5
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=gen)


def _write_weights(out: Path, shapes: dict[str, torch.Size], device: torch.device, seed: int,
                   shard_bytes: int) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(seed)
    shards = _shards(shapes, shard_bytes)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n], gen, device).cpu() for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * s.numel() for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
