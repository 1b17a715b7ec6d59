"""Shared by the LoRA tests: prompts and the Hugging Face + peft reference generations."""
from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), [300, 301, 302, 9, 14, 200]]
MAX_TOKENS = 16


def hf_generate(model_dir: Path, adapter: Path | None, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Greedy generations of transformers (+ peft with ``adapter``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(gen[0, len(prompt):].tolist())
    return out


def no_adapter_paths(root: Path) -> list[Path]:
    """Paths without a readable adapter config, each of a different kind: missing, a file, an
    empty directory, a directory as the config, a dangling symbolic link as the config."""
    (root / "a-file").write_text("{}")
    (root / "empty").mkdir()
    (root / "config-dir" / "adapter_config.json").mkdir(parents=True)
    (root / "dangling").mkdir()
    (root / "dangling" / "adapter_config.json").symlink_to(root / "nowhere")
    return [root / "nope", root / "a-file", root / "empty", root / "config-dir", root / "dangling"]
