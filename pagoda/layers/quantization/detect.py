"""Pre-quantized checkpoints: the formats pagoda reads, chosen by the ``quant_method`` of the
checkpoint's ``quantization_config`` (config.json, else ``quantize_config.json``; found by
``pagoda.config``), and a clear refusal for the ones it does not.

``CHECKPOINT_FORMATS`` is the one table of them: a format is a ``QuantizationConfig`` subclass in
its own module, listed here under its ``name``. Its ``from_config`` raises ``ValueError`` naming
any variant it does not handle (bit width, layout, activation quantization, ...), so an
unsupported checkpoint fails at load, before any weight is read, and never loads as something
else.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.layers.quantization.awq import AWQConfig
from pagoda.layers.quantization.base import QuantizationConfig
from pagoda.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagoda.layers.quantization.fp8_block import Fp8CheckpointConfig
from pagoda.layers.quantization.gguf_quant import GGUFConfig
from pagoda.layers.quantization.gptq import GPTQConfig
from pagoda.layers.quantization.mxfp4 import Mxfp4Config

if TYPE_CHECKING:
    from pagoda.config import ModelConfig

CHECKPOINT_FORMATS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (GPTQConfig, AWQConfig, Fp8CheckpointConfig, CompressedTensorsConfig, GGUFConfig,
                              Mxfp4Config)}

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
    "quark": "AMD Quark checkpoints",
    "torchao": "torchao checkpoints",
    "auto-round": "AutoRound checkpoints",
    "bitnet": "BitNet checkpoints",
}


def checkpoint_quantization_config(method: str, config: dict[str, Any],
                                   model: "ModelConfig | None" = None) -> QuantizationConfig:
    """The config of a checkpoint quantized with ``method``; ``ValueError`` names what is not
    supported."""
    hf = getattr(model, "hf_config", None) or {}
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    # fp8 and mxfp4 experts are dequantized at load (fp8_block / mxfp4 .checkpoint_tensors)
    if experts and method not in ("fp8", "mxfp4"):
        raise ValueError(f"pre-quantized mixture-of-experts checkpoints ({model.architecture}, {method}) are not "
                         "supported: pagoda's expert layers load only unquantized weights")
    cls = CHECKPOINT_FORMATS.get(method)
    if cls is None:
        what = _UNSUPPORTED.get(method, f"checkpoints with quant_method {method!r}")
        raise ValueError(f"{what} are not supported; pagoda loads pre-quantized checkpoints in the "
                         f"formats {', '.join(sorted(CHECKPOINT_FORMATS))} (see docs/quantization.md)")
    return cls.from_config(config, True)
