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
