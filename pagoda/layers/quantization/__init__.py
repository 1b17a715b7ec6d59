"""Weight quantization: the ``QuantizationConfig`` / ``LinearMethod`` seam (``base.py``), the
kernels formats target (``kernels.py``) and the formats themselves, registered by name.

``get_quantization_config(model_config)`` builds a model's config once, from
``ModelConfig.quantization`` (the method: ``--quantization`` or the checkpoint's
``quant_method``) and ``ModelConfig.quantization_config`` (the options: the checkpoint's
``quantization_config``, or ``--quantization-config`` for online methods).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod

if TYPE_CHECKING:
    from pagoda.config import ModelConfig

__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "QUANTIZATION_METHODS",
           "register_quantization_config", "get_quantization_config"]

# method name -> config class
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(name: str) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    def register(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if name in QUANTIZATION_METHODS:
            raise ValueError(f"quantization method {name!r} is registered twice")
        cls.name = name
        QUANTIZATION_METHODS[name] = cls
        return cls

    return register


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


# Formats register themselves on import.
from pagoda.layers.quantization import online  # noqa: E402,F401
