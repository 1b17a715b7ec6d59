"""Shared pieces of the vision-language tests: a random-weight checkpoint per family, test
images, and the transformers reference run on the same checkpoint and images."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagoda import LLM, SamplingParams

# Families and their transformers classes (skipped where the installed transformers lacks one).
FAMILIES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
# LLaVA with a SigLIP tower (make_vlm's variants), tested in test_llava.py.
LLAVA_FAMILIES = {"llava_siglip": "LlavaForConditionalGeneration",
                  "llava_siglip_qwen2": "LlavaForConditionalGeneration"}


def image(seed: int, height: int, width: int):
    """A noise image of the given size (a stand-in photo: every pixel matters to the encoder)."""
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@dataclass
class Reference:
    """transformers' model, image processor and tokenizer of one checkpoint."""

    path: Path
    model: object
    image_processor: object
    tokenizer: object

    def chat_prompt(self, parts: list) -> str:
        """A one-turn chat whose user content is ``parts``: strings (text) and None (an image)."""
        content = [{"type": "text", "text": p} if p is not None else {"type": "image"} for p in parts]
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)

    def greedy(self, prompt_ids: list[int], images: list, n: int) -> tuple[list[int], list[float]]:
        """Greedy tokens of the expanded ``prompt_ids`` with ``images``, and each token's logprob."""
        ids = torch.tensor([prompt_ids])
        kwargs: dict = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="pt")
            kwargs = dict(pixel_values=pixels["pixel_values"])
            if "image_grid_thw" in pixels:  # Qwen's; LLaVA's processor gives whole images
                kwargs.update(image_grid_thw=pixels["image_grid_thw"],
                              mm_token_type_ids=(ids == self.model.config.image_token_id).int())
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, **kwargs)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        lps = [row[0].float().log_softmax(-1)[t].item() for row, t in zip(out.logits, tokens)]
        return tokens, lps


def load_reference(path: Path, family: str) -> Reference:
    import transformers

    transformers.logging.set_verbosity_error()
    model = getattr(transformers, {**FAMILIES, **LLAVA_FAMILIES}[family]).from_pretrained(str(path), dtype=torch.float32).eval()
    return Reference(path, model, transformers.AutoImageProcessor.from_pretrained(str(path)),
                     transformers.AutoTokenizer.from_pretrained(str(path)))


def greedy_params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def run(llm: LLM, prompts: list[dict], n: int) -> list:
    return llm.generate(prompts, greedy_params(n), use_tqdm=False)


def sampled_logprobs(output) -> list[float]:
    sample = output.outputs[0]
    return [entry[token] for entry, token in zip(sample.logprobs, sample.token_ids)]


ATOL = 2e-4  # float32 logprobs against transformers


def check_greedy(ref: Reference, output, images: list, n: int = 6) -> None:
    """``output``'s greedy tokens equal transformers' on its own prompt ids and images, and its
    sampled logprobs agree within ``ATOL``."""
    import pytest

    tokens, lps = ref.greedy(output.prompt_token_ids, images, n)
    assert output.outputs[0].token_ids == tokens
    assert sampled_logprobs(output) == pytest.approx(lps, abs=ATOL)
