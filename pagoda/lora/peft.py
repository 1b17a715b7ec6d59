"""PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors`` (or ``.bin``).

``read_adapter_config`` checks everything the config says (pure Python, so the API server can
refuse a bad adapter before the engine sees it); ``load_adapter_weights`` reads the tensors and
checks their names and shapes against the base model. What pagoda cannot apply exactly is
refused with a ``ValueError`` naming the reason, never silently dropped: targets other than the
attention and MLP projections (embeddings, the LM head), ``modules_to_save``, DoRA, trained
biases, per-module rank or alpha patterns, and ranks above ``max_lora_rank``.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagoda.config import ModelConfig

logger = logging.getLogger(__name__)

# The one refusal for every path that holds no readable adapter config: it does not exist, is
# not a directory, cannot be read, or holds no adapter_config.json. A client that may name paths
# (runtime loading) learns nothing from it about which files the server has.
NO_ADAPTER = "no readable PEFT adapter there (a directory holding adapter_config.json)"

# PEFT target name -> (pagoda module of the decoder layer, sub-projection of a fused layer)
TARGETS: dict[str, tuple[str, str | int | None]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
# PEFT's shorthand for every linear layer but the output head: the seven above in this family.
ALL_LINEAR = "all-linear"
# A target_modules regular expression: its length and the time one module-name match may take.
MAX_TARGET_REGEX_CHARS = 4096
TARGET_REGEX_TIMEOUT_S = 0.1

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+?)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """What pagoda uses of a PEFT ``LoraConfig``."""

    path: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: frozenset[str]  # PEFT names, a subset of ``TARGETS``

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def _refuse(path: str, reason: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {reason}")


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    """Read and check ``path/adapter_config.json``; raises ``ValueError`` naming the problem
    (``NO_ADAPTER`` alike for every path without a readable config; the detail is logged)."""
    try:
        # Missing, not a directory, unreadable, a directory as the config: all OSErrors.
        text = (Path(path) / "adapter_config.json").read_text()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, or not UTF-8
        logger.warning("LoRA adapter %r refused: %s", path, exc)
        raise _refuse(path, NO_ADAPTER) from None
    try:
        raw: dict[str, Any] = json.loads(text)
    except ValueError as exc:
        raise _refuse(path, f"adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise _refuse(path, "adapter_config.json must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(path, f"peft_type {peft_type!r} is not supported (only LORA)")
    _check_unsupported(path, raw)
    r, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if type(r) is not int or r < 1:
        raise _refuse(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _refuse(path, f"rank {r} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(str(path), r, float(alpha), bool(raw.get("use_rslora", False)),
                         _targets(path, raw.get("target_modules")))


def _check_unsupported(path: str, raw: dict[str, Any]) -> None:
    if raw.get("use_dora"):
        raise _refuse(path, "DoRA (use_dora) adapters are not supported")
    if raw.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {raw['modules_to_save']} is not supported (only LoRA deltas on "
                            f"the attention and MLP projections)")
    if raw.get("bias", "none") != "none":
        raise _refuse(path, f"bias {raw['bias']!r} is not supported (only 'none')")
    if raw.get("fan_in_fan_out"):
        raise _refuse(path, "fan_in_fan_out is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise _refuse(path, f"per-module {key} is not supported")
    for key in ("use_qalora", "lora_bias", "alora_invocation_tokens", "trainable_token_indices",
                "layer_replication", "target_parameters", "use_bdlora"):
        if raw.get(key):
            raise _refuse(path, f"{key} is not supported")


def _targets(path: str, raw: Any) -> frozenset[str]:
    if raw == ALL_LINEAR:
        return frozenset(TARGETS)
    if isinstance(raw, str):
        found = _regex_targets(path, raw)
        if not found:
            raise _refuse(path, f"target_modules {raw!r} matches none of {sorted(TARGETS)}")
        return found
    if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(t, str) for t in raw):
        raise _refuse(path, f"target_modules must be a non-empty list of module names, got {raw!r}")
    unsupported = sorted(set(raw) - set(TARGETS))
    if unsupported:
        raise _refuse(path, f"target modules {unsupported} are not supported; LoRA may target "
                            f"{sorted(TARGETS)}")
    return frozenset(raw)


def _regex_targets(path: str, raw: str) -> frozenset[str]:
    """The targets whose module names the regular expression ``raw`` matches, as PEFT allows.
    The pattern comes from a file a client may have written: it is matched by the ``regex``
    engine with a time limit (and without the GIL), so a catastrophic pattern is refused in
    ``TARGET_REGEX_TIMEOUT_S`` instead of wedging the process."""
    import regex

    if len(raw) > MAX_TARGET_REGEX_CHARS:
        raise _refuse(path, f"the target_modules pattern is longer than {MAX_TARGET_REGEX_CHARS} characters")
    try:
        pattern = regex.compile(raw)
        return frozenset(t for t in TARGETS if any(
            pattern.fullmatch(f"model.layers.0.{part}.{t}", timeout=TARGET_REGEX_TIMEOUT_S, concurrent=True)
            for part in ("self_attn", "mlp")))
    except regex.error as exc:
        raise _refuse(path, f"target_modules {raw!r} is not a valid regular expression: {exc}") from exc
    except TimeoutError as exc:
        raise _refuse(path, f"matching the target_modules pattern took longer than {TARGET_REGEX_TIMEOUT_S:g} s; "
                            "give a list of module names or a simpler pattern") from exc


# ---- tensors (torch) ------------------------------------------------------------------------

def module_shape(model: "ModelConfig", target: str) -> tuple[int, int]:
    """(in_features, out_features) of a PEFT target in the full (unsharded) model."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[target]


def load_adapter_weights(cfg: AdapterConfig, model: "ModelConfig"
                         ) -> dict[tuple[int, str], tuple["torch.Tensor", "torch.Tensor"]]:
    """``{(layer, PEFT target): (A [r, in], B * scaling [out, r])}`` in float32 on the host,
    checked against the base model; raises ``ValueError`` for anything that does not fit."""
    tensors = _read_tensors(cfg.path)
    halves: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise _refuse(cfg.path, f"weight {key!r} is not a LoRA A/B matrix of a supported target "
                                    f"({sorted(TARGETS)})")
        layer, target, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= model.num_layers:
            raise _refuse(cfg.path, f"weight {key!r} names layer {layer}; the model has {model.num_layers}")
        if target not in cfg.target_modules:
            raise _refuse(cfg.path, f"weight {key!r} targets {target}, which target_modules does not list")
        halves.setdefault((layer, target), {})[half] = tensor
    if not halves:
        raise _refuse(cfg.path, "the weights file holds no LoRA matrices")
    out = {}
    for (layer, target), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(cfg.path, f"layer {layer} {target} has lora_{''.join(pair)} but not both A and B")
        out[(layer, target)] = _checked(cfg, model, layer, target, pair["A"], pair["B"])
    return out


def _checked(cfg: AdapterConfig, model: "ModelConfig", layer: int, target: str, a: "torch.Tensor",
             b: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch

    fan_in, fan_out = module_shape(model, target)
    if tuple(a.shape) != (cfg.r, fan_in) or tuple(b.shape) != (fan_out, cfg.r):
        raise _refuse(cfg.path, f"layer {layer} {target}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                                f"fit the model (expected ({cfg.r}, {fan_in}) and ({fan_out}, {cfg.r}))")
    a, b = a.to(torch.float32), b.to(torch.float32)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise _refuse(cfg.path, f"layer {layer} {target}: the weights hold NaN or infinity")
    return a, b * cfg.scaling


def _read_tensors(path: str) -> dict[str, "torch.Tensor"]:
    import torch

    base = Path(path)
    st, binary = base / "adapter_model.safetensors", base / "adapter_model.bin"
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except (SafetensorError, OSError, ValueError) as exc:
            raise _refuse(path, f"adapter_model.safetensors cannot be read: {exc}") from exc
    if binary.is_file():
        try:  # weights_only: a pickle that is more than tensors is refused, never executed
            loaded = torch.load(str(binary), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise _refuse(path, f"adapter_model.bin cannot be read as plain tensors: {exc}") from exc
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise _refuse(path, "adapter_model.bin does not hold a dict of tensors")
        return loaded
    raise _refuse(path, "no adapter_model.safetensors (or adapter_model.bin)")
