"""Maps a checkpoint's ``architectures`` name to the pagoda model class that runs it and the
config flags that distinguish the family members. Torch-free: the model class is named by its
import path and imported only when a model is built."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _not_hybrid(hf: dict) -> bool:
    return False


@dataclass(frozen=True)
class ArchSpec:
    name: str
    # Reads flags (qkv_bias, o_bias, qk_norm) from the checkpoint's config.json.
    flags_from: Callable[[dict], dict] = field(default=lambda hf: {})
    # "module:Class" of the model; every architecture but DeepSeek shares the one decoder.
    model_class: str = "pagoda.models.decoder:DecoderForCausalLM"
    # Per layer: the sliding-window size or None (full attention).
    windows_from: Callable[[dict], tuple] = field(default=lambda hf: ())
    # The attention head size where config.json's ``head_dim`` does not say it (MLA).
    head_dim_from: Callable[[dict], int | None] = field(default=lambda hf: None)
    # Takes images: a vision encoder feeds the decoder (``pagoda/multimodal``).
    multimodal: bool = False
    # Whether a checkpoint has recurrent (Mamba) layers beside attention: a state slot per
    # sequence, no prefix reuse.
    hybrid_from: Callable[[dict], bool] = field(default=_not_hybrid)


def _llama_flags(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}


def _qwen2_flags(hf: dict) -> dict:
    return {"qkv_bias": True, "o_bias": False, "qk_norm": False}  # Qwen2 always biases q/k/v


def _llava_flags(hf: dict) -> dict:
    """LLaVA's language model: Qwen2's flags for a Qwen2 ``text_config``, else Llama's."""
    return _qwen2_flags(hf) if hf.get("model_type") == "qwen2" else _llama_flags(hf)


def _qwen2_moe_flags(hf: dict) -> dict:
    return {"qkv_bias": bool(hf.get("qkv_bias", True)), "o_bias": False, "qk_norm": False}


def _qwen3_flags(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def _window(hf: dict) -> int | None:
    w = hf.get("sliding_window")
    return int(w) if w else None  # 0 and null both mean no window


def _all_layers_window(hf: dict) -> tuple:
    """Mistral, Mixtral: one window for every layer when the config sets one."""
    return (_window(hf),) * hf["num_hidden_layers"]


def _use_sliding_window_all_layers(hf: dict) -> tuple:
    """Qwen3-MoE: the window applies to every layer, but only with ``use_sliding_window``."""
    w = _window(hf) if hf.get("use_sliding_window", False) else None
    return (w,) * hf["num_hidden_layers"]


def _layer_types_windows(default_rule: Callable[[dict, int], bool]) -> Callable[[dict], tuple]:
    """Qwen2/Qwen3(-MoE): ``layer_types`` names each layer's attention; configs without it
    derive it from ``use_sliding_window`` and ``max_window_layers`` by the family's rule."""

    def windows(hf: dict) -> tuple:
        n = hf["num_hidden_layers"]
        w = _window(hf) if hf.get("use_sliding_window", False) else None
        if w is None:
            return (None,) * n
        types = hf.get("layer_types") or ["sliding_attention" if default_rule(hf, i) else "full_attention"
                                          for i in range(n)]
        return tuple(w if t == "sliding_attention" else None for t in types)

    return windows


def _qwen2_rule(hf: dict, i: int) -> bool:
    return i >= hf.get("max_window_layers", 28)


def _qwen2_moe_rule(hf: dict, i: int) -> bool:
    return bool((i + 1) % 2) and i < hf.get("max_window_layers", 28)


def _glm4_flags(hf: dict) -> dict:
    return {"qkv_bias": bool(hf.get("attention_bias", True)), "o_bias": False, "qk_norm": False}


def _gemma3_flags(hf: dict) -> dict:
    return {**_llama_flags(hf), "qk_norm": True}


def _layer_types_pattern(pattern_default: int) -> Callable[[dict], tuple]:
    """Gemma 2/3: ``layer_types`` names each layer's attention; configs without it repeat
    ``pattern - 1`` local (sliding-window) layers and one global layer (Gemma 2: 2, Gemma 3: 6)."""

    def windows(hf: dict) -> tuple:
        n, w = hf["num_hidden_layers"], _window(hf)
        if w is None:
            return (None,) * n
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or pattern_default
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n)]
        return tuple(w if t == "sliding_attention" else None for t in types)

    return windows


def _gpt_oss_flags(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", True))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}


def _layer_types_windows_or_all(hf: dict) -> tuple:
    """gpt-oss: ``layer_types`` names each layer's attention (sliding or full); configs without
    it alternate, starting with a sliding layer."""
    n, w = hf["num_hidden_layers"], _window(hf)
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return tuple(w if t == "sliding_attention" else None for t in types)


def _mla_head_dim(hf: dict) -> int:
    return hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]


_MAMBA_TYPES = ("mamba", "linear_attention")
_ATTENTION_TYPES = ("attention", "full_attention")


def layer_kinds(hf: dict) -> list[str]:
    """Each layer's kind, ``mamba`` or ``attention``, from ``layer_types``
    (``layers_block_type`` in older configs)."""
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * hf["num_hidden_layers"]
    kinds = []
    for t in types:
        if t not in _MAMBA_TYPES + _ATTENTION_TYPES:
            raise ValueError(f"GraniteMoeHybridForCausalLM layer type {t!r} is not supported "
                             f"(supported: {', '.join(_MAMBA_TYPES + _ATTENTION_TYPES)})")
        kinds.append("mamba" if t in _MAMBA_TYPES else "attention")
    return kinds


def bamba_layer_kinds(hf: dict) -> list[str]:
    """Bamba: attention at ``attn_layer_indices`` (or as ``layer_types`` says), Mamba elsewhere."""
    if hf.get("layer_types") or hf.get("layers_block_type"):
        return layer_kinds(hf)
    attention = set(hf.get("attn_layer_indices") or [])
    return ["attention" if i in attention else "mamba" for i in range(hf["num_hidden_layers"])]


_MOE = "pagoda.models.moe:MoEForCausalLM"
_GEMMA = "pagoda.models.gemma:GemmaForCausalLM"
_LLAMA4 = "pagoda.models.llama4:Llama4ForCausalLM"

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LlamaForCausalLM", _llama_flags),
    "MistralForCausalLM": ArchSpec("MistralForCausalLM", _llama_flags, windows_from=_all_layers_window),
    "Qwen2ForCausalLM": ArchSpec("Qwen2ForCausalLM", _qwen2_flags,
                                 windows_from=_layer_types_windows(_qwen2_rule)),
    "Qwen3ForCausalLM": ArchSpec("Qwen3ForCausalLM", _qwen3_flags,
                                 windows_from=_layer_types_windows(_qwen2_rule)),
    "MixtralForCausalLM": ArchSpec("MixtralForCausalLM", _llama_flags, _MOE, _all_layers_window),
    "Qwen2MoeForCausalLM": ArchSpec("Qwen2MoeForCausalLM", _qwen2_moe_flags, _MOE,
                                    _layer_types_windows(_qwen2_moe_rule)),
    "Qwen3MoeForCausalLM": ArchSpec("Qwen3MoeForCausalLM", _qwen3_flags, _MOE, _use_sliding_window_all_layers),
    "DeepseekV3ForCausalLM": ArchSpec("DeepseekV3ForCausalLM", _llama_flags,
                                      "pagoda.models.deepseek_v3:DeepseekV3ForCausalLM",
                                      head_dim_from=_mla_head_dim),
    "Gemma2ForCausalLM": ArchSpec("Gemma2ForCausalLM", _llama_flags, _GEMMA, _layer_types_pattern(2)),
    "Gemma3ForCausalLM": ArchSpec("Gemma3ForCausalLM", _gemma3_flags, _GEMMA, _layer_types_pattern(6)),
    "Phi3ForCausalLM": ArchSpec("Phi3ForCausalLM", _llama_flags, "pagoda.models.families:Phi3ForCausalLM",
                                _all_layers_window),
    "Olmo2ForCausalLM": ArchSpec("Olmo2ForCausalLM", _llama_flags, "pagoda.models.families:Olmo2ForCausalLM"),
    "Glm4ForCausalLM": ArchSpec("Glm4ForCausalLM", _glm4_flags, "pagoda.models.families:Glm4ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ArchSpec("Qwen2_5_VLForConditionalGeneration", _qwen2_flags,
                                                   "pagoda.models.qwen_vl:Qwen2_5_VLForConditionalGeneration",
                                                   multimodal=True),
    "Qwen3VLForConditionalGeneration": ArchSpec("Qwen3VLForConditionalGeneration", _qwen3_flags,
                                                "pagoda.models.qwen_vl:Qwen3VLForConditionalGeneration",
                                                multimodal=True),
    "LlavaForConditionalGeneration": ArchSpec("LlavaForConditionalGeneration", _llava_flags,
                                              "pagoda.models.llava:LlavaForConditionalGeneration", multimodal=True),
    "GptOssForCausalLM": ArchSpec("GptOssForCausalLM", _gpt_oss_flags, "pagoda.models.gpt_oss:GptOssForCausalLM",
                                  _layer_types_windows_or_all),
    "Llama4ForCausalLM": ArchSpec("Llama4ForCausalLM", _llama_flags, _LLAMA4),
    # Loaded text-only: the language model's weights, its config from ``text_config``.
    "Llama4ForConditionalGeneration": ArchSpec("Llama4ForConditionalGeneration", _llama_flags, _LLAMA4),
    "GraniteMoeHybridForCausalLM": ArchSpec("GraniteMoeHybridForCausalLM", _llama_flags,
                                            "pagoda.models.granite_hybrid:GraniteMoeHybridForCausalLM",
                                            hybrid_from=lambda hf: "mamba" in layer_kinds(hf)),
    "BambaForCausalLM": ArchSpec("BambaForCausalLM", _llama_flags, "pagoda.models.bamba:BambaForCausalLM",
                                 hybrid_from=lambda hf: "mamba" in bamba_layer_kinds(hf)),
}


def resolve_architecture(names: list[str]) -> ArchSpec:
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"unsupported model architecture {names or '(none given)'}; pagoda supports: "
                     f"{', '.join(ARCHITECTURES)}")


def supported_summary() -> str:
    """Every architecture pagoda loads, in one paragraph (``pagoda serve --help``): the text
    models, then the multimodal (image) ones and the hybrids (Mamba layers beside attention)."""
    groups = {"text": [], "multimodal": [], "hybrid (Mamba-2 layers beside attention)": []}
    for name, spec in ARCHITECTURES.items():
        kind = "multimodal" if spec.multimodal else "text"
        if spec.hybrid_from is not _not_hybrid:
            kind = "hybrid (Mamba-2 layers beside attention)"
        groups[kind].append(name)
    listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in groups.items() if names)
    return f"Supported model architectures (config.json 'architectures'; any other is refused at start-up): {listed}."


def model_class(architecture: str) -> type:
    """The model class that runs ``architecture`` (imports torch)."""
    import importlib

    module, name = ARCHITECTURES[architecture].model_class.split(":")
    return getattr(importlib.import_module(module), name)
