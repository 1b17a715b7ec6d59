"""The text-only twin of a vision-language checkpoint: its language model alone, written as the
plain text checkpoint of the same decoder (Qwen2.5-VL -> ``Qwen2ForCausalLM``, Qwen3-VL ->
``Qwen3ForCausalLM``, LLaVA -> its ``text_config``'s Llama or Qwen2), with the same tokenizer.

A text prompt gives the same tokens on both (a text token's M-RoPE position is its index on
every axis, which is plain RoPE), so ``pagoda bench throughput --compare text-twin`` can hold a
vision model's text-only cost against the text model's in one run.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

# A vision-language checkpoint's text_config model_type -> the text model's (architecture, model_type).
TEXT_MODELS = {
    "qwen2_5_vl_text": ("Qwen2ForCausalLM", "qwen2"), "qwen2_vl_text": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3_vl_text": ("Qwen3ForCausalLM", "qwen3"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Checkpoint name prefixes of the language model, and what the text model calls them.
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.layers.", "model.layers."),
            ("model.embed_tokens.", "model.embed_tokens."), ("model.norm.", "model.norm."), ("lm_head.", "lm_head."))
# Files of the vision side that the text model has no use for.
_VISION_FILES = {"preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"}


def text_weight_name(name: str) -> str | None:
    """The text model's name of a checkpoint tensor, or None for the vision tower's and the
    projector's."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def text_config(hf: dict) -> dict:
    """The text model's config.json from the vision-language one's."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("not a vision-language checkpoint: its config.json has no text_config")
    kind = text.get("model_type")
    if kind not in TEXT_MODELS:
        raise ValueError(f"no text twin for a language model of type {kind!r}; known: {sorted(TEXT_MODELS)}")
    arch, model_type = TEXT_MODELS[kind]
    cfg = {**text, "architectures": [arch], "model_type": model_type}
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if key in hf and key not in text:
            cfg[key] = hf[key]
    return cfg


def write_text_twin(vlm: str | Path, out: str | Path) -> Path:
    """Write ``vlm``'s text-only twin to ``out`` (safetensors weights, shard by shard); returns
    ``out``."""
    from safetensors.torch import load_file, save_file

    vlm, out = Path(vlm), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = json.loads((vlm / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(text_config(hf), indent=2))
    shards = sorted(vlm.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{vlm} holds no safetensors weights")
    weight_map: dict[str, str] = {}
    for shard in shards:
        tensors = {new: t for name, t in load_file(str(shard)).items() if (new := text_weight_name(name))}
        if tensors:
            save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
            weight_map.update({name: shard.name for name in tensors})
    if (vlm / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for path in vlm.iterdir():
        if (path.is_file() and path.suffix != ".safetensors" and path.name not in _VISION_FILES
                and path.name not in ("config.json", "model.safetensors.index.json")):
            shutil.copy(path, out / path.name)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pagoda.tools.text_twin VLM OUT``."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("vlm")
    p.add_argument("out")
    a = p.parse_args(argv)
    print(write_text_twin(a.vlm, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
