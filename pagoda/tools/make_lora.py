"""Random PEFT LoRA adapters for a checkpoint (tests and ``pagoda bench lora``).

The adapter is made by the ``peft`` package itself (``get_peft_model`` + ``save_pretrained``),
so its files are exactly what a trained PEFT adapter looks like; only the values are random,
large enough (``std``) that the adapter visibly changes the model's outputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def make_lora(model_dir: str | Path, out: str | Path, r: int = 8, target_modules: Sequence[str] = ("q_proj", "v_proj"),
              lora_alpha: float = 16.0, use_rslora: bool = False, seed: int = 0, std: float = 0.1) -> Path:
    """Write a random LoRA adapter for ``model_dir`` into ``out``; returns ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    out = Path(out)
    model.save_pretrained(str(out))
    return out


def write_random_lora(model_dir: str | Path, out: str | Path, r: int = 16,
                      target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"),
                      lora_alpha: float = 32.0, seed: int = 0, std: float = 0.02) -> Path:
    """The same files as ``make_lora`` (PEFT's names and config keys), written directly from
    the model's ``config.json`` without loading the model: fast enough for a benchmark's
    many adapters on a large checkpoint."""
    import json

    import torch
    from safetensors.torch import save_file

    from pagoda.config import ModelConfig
    from pagoda.lora.peft import module_shape

    model = ModelConfig.from_pretrained(str(model_dir), None, "float32", None, "cpu")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for target in target_modules:
            fan_in, fan_out = module_shape(model, target)
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "target_modules": list(target_modules),
              "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
              "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
