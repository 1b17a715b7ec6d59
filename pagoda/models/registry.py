"""Maps a checkpoint's ``architectures`` name to pagoda's one decoder implementation and the
config flags that distinguish the family members."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class ArchSpec:
    name: str
    # Reads flags (qkv_bias, o_bias, qk_norm) from the checkpoint's config.json.
    flags_from: Callable[[dict], dict] = field(default=lambda hf: {})


def _llama_flags(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}


def _qwen2_flags(hf: dict) -> dict:
    return {"qkv_bias": True, "o_bias": False, "qk_norm": False}  # Qwen2 always biases q/k/v


def _qwen3_flags(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LlamaForCausalLM", _llama_flags),
    "MistralForCausalLM": ArchSpec("MistralForCausalLM", _llama_flags),
    "Qwen2ForCausalLM": ArchSpec("Qwen2ForCausalLM", _qwen2_flags),
    "Qwen3ForCausalLM": ArchSpec("Qwen3ForCausalLM", _qwen3_flags),
}


def resolve_architecture(names: list[str]) -> ArchSpec:
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"unsupported model architecture {names or '(none given)'}; pagoda supports: "
                     f"{', '.join(ARCHITECTURES)}")
