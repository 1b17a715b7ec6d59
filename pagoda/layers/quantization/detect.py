"""Pre-quantized checkpoints: the formats pagoda reads, chosen by the ``quant_method`` of the
checkpoint's ``quantization_config`` (config.json, else ``quantize_config.json``; found by
``pagoda.config``), and a clear refusal for the ones it does not.

Each format module registers a ``QuantizationConfig`` subclass here with
``register_checkpoint_format``; its ``from_config`` raises ``ValueError`` naming any variant it
does not handle (bit width, layout, activation quantization, ...), so an unsupported checkpoint
fails at load, before any weight is read, and never loads as something else.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Iterable

from pagoda.layers.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from pagoda.config import ModelConfig

CHECKPOINT_FORMATS: dict[str, type[QuantizationConfig]] = {}

# quant_method values of formats pagoda knows and does not read, with what to say about them.
_UNSUPPORTED: dict[str, str] = {
    "bitsandbytes": "bitsandbytes (NF4/int8) checkpoints",
    "gptq_marlin": "GPTQ checkpoints repacked for the Marlin kernel",
    "awq_marlin": "AWQ checkpoints repacked for the Marlin kernel",
    "marlin": "Marlin-format checkpoints",
    "exl2": "ExLlamaV2 (exl2) checkpoints",
    "aqlm": "AQLM checkpoints",
    "hqq": "HQQ checkpoints",
    "eetq": "EETQ checkpoints",
    "fbgemm_fp8": "FBGEMM fp8 checkpoints",
    "modelopt": "NVIDIA ModelOpt checkpoints",
    "mxfp4": "MXFP4 checkpoints",
    "quark": "AMD Quark checkpoints",
    "torchao": "torchao checkpoints",
    "auto-round": "AutoRound checkpoints",
    "bitnet": "BitNet checkpoints",
}


def register_checkpoint_format(name: str) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    def register(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if name in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format {name!r} is registered twice")
        cls.name = name
        CHECKPOINT_FORMATS[name] = cls
        return cls

    return register


def checkpoint_quantization_config(method: str, config: dict[str, Any],
                                   model: "ModelConfig | None" = None) -> QuantizationConfig:
    """The config of a checkpoint quantized with ``method``; ``ValueError`` names what is not
    supported."""
    _load_formats()
    hf = getattr(model, "hf_config", None) or {}
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    if experts and method != "fp8":  # fp8 experts are dequantized at load (fp8_block.checkpoint_tensors)
        raise ValueError(f"pre-quantized mixture-of-experts checkpoints ({model.architecture}, {method}) are not "
                         "supported: pagoda's expert layers load only unquantized weights")
    cls = CHECKPOINT_FORMATS.get(method)
    if cls is None:
        what = _UNSUPPORTED.get(method, f"checkpoints with quant_method {method!r}")
        raise ValueError(f"{what} are not supported; pagoda loads pre-quantized checkpoints in the "
                         f"formats {', '.join(sorted(CHECKPOINT_FORMATS))} (see docs/quantization.md)")
    return cls.from_config(config, True)


def _load_formats() -> None:
    from pagoda.layers.quantization import awq, compressed_tensors, fp8_block, gguf_quant, gptq  # noqa: F401


# ------------------------------------------------------------------ per-layer selection helpers

# pagoda's fused layers and the checkpoint modules they hold (see DecoderForCausalLM.packed_modules).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint module names behind pagoda's layer ``prefix``
    (``model.layers.0.self_attn.qkv_proj`` -> its q_proj, k_proj and v_proj)."""
    head, _, leaf = prefix.rpartition(".")
    parts = _FUSED.get(leaf)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors' target rule: ``re:<regex>`` matches from the start, anything else is
    an exact module name (a bare class name such as ``Linear`` is handled by the caller)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def one_choice(prefix: str, choices: Iterable[Any], what: str) -> Any:
    """The single value every checkpoint module of a fused layer agrees on; a fused layer whose
    parts are quantized differently cannot be one matmul."""
    values = list(choices)
    first = values[0]
    if any(v != first for v in values[1:]):
        raise ValueError(f"{prefix} fuses {', '.join(checkpoint_modules(prefix))}, which the checkpoint "
                         f"{what} differently; pagoda needs them quantized alike")
    return first
