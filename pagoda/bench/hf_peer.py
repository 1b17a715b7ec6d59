"""The Hugging Face ``generate`` peer of ``pagoda bench throughput``, run as a script in its own
process so it gets torch's own OpenMP settings rather than the ones pagoda sets for itself.

Reads ``{"model", "dtype", "prompts", "output_lens", "batch_size"}`` as JSON on stdin and prints
``{"elapsed_s": ...}``. Batched ``generate`` with left padding, as a user would write it: each
batch runs until its longest requested output. Imports nothing from pagoda on purpose.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch


def generate_batch(hf: Any, prompts: list[list[int]], max_new: int, pad: int, device: str = "cpu") -> None:
    """One left-padded ``generate`` call producing exactly ``max_new`` tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                    pad_token_id=pad)


def main() -> None:
    job = json.load(sys.stdin)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"])).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    prompts, output_lens, size = job["prompts"], job["output_lens"], job["batch_size"]
    generate_batch(hf, prompts[:2], 2, pad)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        generate_batch(hf, prompts[i:i + size], max(output_lens[i:i + size]), pad)
    print(json.dumps({"elapsed_s": time.perf_counter() - start, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
