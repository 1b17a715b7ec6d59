"""Build a model and fill it from a Hugging Face safetensors checkpoint (single file or sharded
with ``model.safetensors.index.json``). Tensors are opened lazily and every parameter's
``weight_loader`` reads only the slice this rank owns.

``load_format="dummy"`` reads no weight file: every parameter is drawn at random in place, on
the device, in a range that keeps activations finite (speed measurements of real shapes without
writing or reading their checkpoints)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.linear import copy_checked, full
from pagoda.models import gguf_loader
from pagoda.models.decoder import DecoderForCausalLM
from pagoda.models.registry import model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _replicated(param: torch.nn.Parameter, source: object, shard: object = None) -> None:
    copy_checked(param.data, full(source))


def weight_files(path: str | Path) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise RuntimeError(f"corrupt weight index {index}: {exc}") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"weight files listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {root}")
    return files


def _expected_shards(model: DecoderForCausalLM) -> set[tuple[str, object]]:
    shards = {target: set() for target, _ in model.packed_modules.values()}
    for target, shard in model.packed_modules.values():
        shards[target].add(shard)
    expected: set[tuple[str, object]] = set()
    for name, param in model.named_parameters():
        if getattr(param, "optional", False):  # a quantization method's optional tensor
            continue
        module = name.split(".")[-2]
        if hasattr(param, "expected_shards"):  # stacked experts: one shard per expert and projection
            expected.update((name, s) for s in param.expected_shards)
        elif module in shards:
            expected.update((name, s) for s in shards[module])
        else:
            expected.add((name, None))
    return expected


def _map_name(model: DecoderForCausalLM, name: str) -> tuple[str, object]:
    mapped = getattr(model, "map_weight_name", lambda n: None)(name)
    if mapped is not None:  # the model's own names (experts into stacked weights)
        return mapped
    for ckpt, (target, shard) in model.packed_modules.items():
        part = f".{ckpt}."
        if part in name:
            return name.replace(part, f".{target}."), shard
    return name, None


def _tensors(files: list[Path]) -> Iterator[tuple[Path, str, object]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield file, name, handle.get_slice(name)
        except (OSError, RuntimeError, ValueError) as exc:
            raise RuntimeError(f"cannot read weight file {file}: {exc}") from exc
        except Exception as exc:  # safetensors raises its own error type for corrupt headers
            raise RuntimeError(f"cannot read weight file {file}: {exc}") from exc


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place: matrices ~ N(0, 1/fan_in) (embeddings and LM head N(0, 0.02^2)),
    vectors of ones (norm scales) or zeros (biases), integer tensors zero. Seeded, so every
    tensor-parallel rank and every run draws the same values."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        data = param.data
        gen = gens.setdefault(data.device, torch.Generator(device=data.device).manual_seed(seed))
        if not data.is_floating_point() or name.endswith("bias"):
            data.zero_()
        elif data.dim() == 1:
            data.fill_(1.0)
        else:
            std = 0.02 if "embed_tokens" in name or "lm_head" in name else data.shape[-1] ** -0.5
            data.normal_(0.0, std, generator=gen)


def load_model(cfg: ModelConfig, backend: AttentionBackend, device: str) -> DecoderForCausalLM:
    with torch.device(device):
        model = model_class(cfg.architecture)(cfg, backend)
    if cfg.load_format == "dummy":
        init_dummy_weights(model)
    else:
        _load_checkpoint(model, cfg)
    for module in model.modules():  # quantize / repack (quantization methods); a no-op otherwise
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model.eval()


def _load_checkpoint(model: DecoderForCausalLM, cfg: ModelConfig) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, object]] = set()
    other_stages = model.stage_missing_prefixes()  # pipeline parallelism: other stages' weights
    if cfg.path.endswith(gguf_loader.SUFFIX):  # a llama.cpp file (config.ModelConfig resolved the path)
        tensors = gguf_loader.tensors(cfg, getattr(model, "quant_config", None))
    else:
        tensors = _tensors(weight_files(cfg.path))
    rewrite = getattr(getattr(model, "quant_config", None), "checkpoint_tensors", None)  # fp8 weights of float layers
    for file, ckpt_name, source in (rewrite(tensors) if rewrite is not None else tensors):
        if ckpt_name.endswith(_IGNORED_SUFFIXES):
            continue
        if cfg.tie_word_embeddings and ckpt_name == "lm_head.weight":
            continue
        if getattr(model, "skip_weight", lambda n: False)(ckpt_name) or ckpt_name.startswith(other_stages):
            continue
        name, shard = _map_name(model, ckpt_name)
        if name not in params and f"model.{name}" in params:
            name = f"model.{name}"  # a bare decoder's checkpoint (Qwen3-Embedding's: no "model." prefix)
        param = params.get(name)
        if param is None:
            raise RuntimeError(f"weight {ckpt_name!r} in {file} does not belong to a {cfg.architecture} model")
        try:
            getattr(param, "weight_loader", _replicated)(param, source, shard)
        except RuntimeError as exc:
            raise RuntimeError(f"weight {ckpt_name!r} in {file} does not fit parameter {name} "
                               f"{tuple(param.shape)}: {exc}") from exc
        loaded.add((name, shard))
    missing = _expected_shards(model) - loaded
    if cfg.embedding_only and ("lm_head.weight", None) in missing and not cfg.tie_word_embeddings:
        params["lm_head.weight"].data.zero_()  # never used for an embedding; finite for dummy steps
    if cfg.tie_word_embeddings or cfg.embedding_only:
        missing.discard(("lm_head.weight", None))
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise RuntimeError(f"checkpoint {cfg.path} lacks weights: {', '.join(names[:8])}"
                           + (" ..." if len(names) > 8 else ""))
