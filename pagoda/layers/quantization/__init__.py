"""Weight quantization: the ``QuantizationConfig`` / ``LinearMethod`` seam (``base.py``), the
kernels formats target (``kernels.py``) and the formats themselves, each a ``QuantizationConfig``
subclass listed by name in one table: ``QUANTIZATION_METHODS`` below for the online methods,
``detect.CHECKPOINT_FORMATS`` for pre-quantized checkpoints.

``get_quantization_config(model_config)`` builds a model's config once, from
``ModelConfig.quantization`` (the method: ``--quantization`` or the checkpoint's
``quant_method``) and ``ModelConfig.quantization_config`` (the options: the checkpoint's
``quantization_config``, or ``--quantization-config`` for online methods).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from pagoda.layers.quantization.online import Fp8Config, Int4Config, Int8Config

if TYPE_CHECKING:
    from pagoda.config import ModelConfig

__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "QUANTIZATION_METHODS",
           "get_quantization_config"]

# --quantization NAME -> the online method's config class
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (Int8Config, Int4Config, Fp8Config)}


def get_quantization_config(model: "ModelConfig") -> QuantizationConfig | None:
    """The model's quantization, or None for a float model. ``ValueError`` names an unknown
    method or an option the method does not take."""
    name = model.quantization
    if name is None:
        return None
    if model.quantized_checkpoint:  # pre-quantized: the checkpoint formats (quantization/detect.py)
        from pagoda.layers.quantization.detect import checkpoint_quantization_config

        return checkpoint_quantization_config(name, dict(model.quantization_config or {}), model)
    cls = QUANTIZATION_METHODS.get(name)
    if cls is None:
        where = "the checkpoint's quantization_config" if model.quantized_checkpoint else "--quantization"
        raise ValueError(f"quantization method {name!r} (from {where}) is not supported; "
                         f"supported: {', '.join(sorted(QUANTIZATION_METHODS))}")
    return cls.from_config(dict(model.quantization_config or {}), model.quantized_checkpoint)
