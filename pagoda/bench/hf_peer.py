"""The Hugging Face ``generate`` peer of ``pagoda bench throughput``, run as a script in its own
process so it gets torch's own OpenMP settings rather than the ones pagoda sets for itself.

Reads ``{"model", "dtype", "prompts", "output_lens", "batch_size"}`` as JSON on stdin and prints
``{"elapsed_s": ...}``. Batched ``generate`` with left padding, as a user would write it: each
batch runs until its longest requested output. Imports nothing from pagoda on purpose.

With ``"images": {"per_prompt", "height", "width", "seed"}`` the model is a vision-language one:
each prompt's images are drawn as pagoda's benchmark draws them (``noise_image``), preprocessed
by the checkpoint's image processor inside the timed loop, and each prompt's image placeholder
expanded to the image's feature count, as the model's own processor would.
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


def noise_image(seed: int, height: int, width: int) -> Any:
    """The benchmark's image ``seed`` (the same function as ``pagoda.bench.throughput``'s)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def generate_vlm_batch(hf: Any, processor: Any, prompts: list[list[int]], images: list[list[Any]], max_new: int,
                       pad: int) -> None:
    """``generate_batch`` for a vision-language model: preprocess the batch's images, expand each
    placeholder, left-pad, generate ``max_new`` tokens per prompt."""
    flat = [im for ims in images for im in ims]
    pixels = processor(images=flat, return_tensors="pt")
    image_id = _image_token_id(hf.config)
    if "image_grid_thw" in pixels:  # Qwen's: a grid per image
        counts = iter((pixels["image_grid_thw"].prod(-1) // processor.merge_size ** 2).tolist())
    else:  # LLaVA's: one fixed grid
        counts = iter([_fixed_image_tokens(hf.config)] * len(flat))
    expanded = [[t for tok in p for t in ([image_id] * next(counts) if tok == image_id else [tok])] for p in prompts]
    width = max(len(p) for p in expanded)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in expanded])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in expanded])
    kwargs: dict[str, Any] = {"pixel_values": pixels["pixel_values"]}
    if "image_grid_thw" in pixels:
        kwargs.update(image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == image_id).int())
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                    do_sample=False, pad_token_id=pad, **kwargs)


def _image_token_id(config: Any) -> int:
    token = getattr(config, "image_token_id", None)
    return int(token if token is not None else config.image_token_index)


def _fixed_image_tokens(config: Any) -> int:
    """Features per image of a LLaVA tower: its patch grid, less the first row under the
    "default" feature strategy."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 - (config.vision_feature_select_strategy == "default")


def main_vlm(job: dict) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"])).eval()
    processor = AutoImageProcessor.from_pretrained(job["model"])
    spec = job["images"]
    text = hf.config.get_text_config()
    pad = text.pad_token_id if text.pad_token_id is not None else 0
    prompts, output_lens, size = job["prompts"], job["output_lens"], job["batch_size"]
    images = [[noise_image(spec["seed"] + i * spec["per_prompt"] + j, spec["height"], spec["width"])
               for j in range(spec["per_prompt"])] for i in range(len(prompts))]
    generate_vlm_batch(hf, processor, prompts[:2], images[:2], 2, pad)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        generate_vlm_batch(hf, processor, prompts[i:i + size], images[i:i + size], max(output_lens[i:i + size]), pad)
    print(json.dumps({"elapsed_s": time.perf_counter() - start, "threads": torch.get_num_threads()}))


def main() -> None:
    job = json.load(sys.stdin)
    if job.get("images"):
        main_vlm(job)
        return
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
