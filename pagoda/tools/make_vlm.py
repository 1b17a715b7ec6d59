"""Random-weight vision-language checkpoints (Qwen2.5-VL, Qwen3-VL) for tests and benchmarks.

Like ``make_model``, the weights come from transformers' own config and model classes with
seeded values (``make_model._init_weights``'s scheme, which gives clear greedy margins), and the
tokenizer is ``make_model``'s locally trained BPE, here with Qwen's vision tokens added
(``<|vision_start|>``, ``<|image_pad|>``, ...) and a chat template that renders image parts. The
checkpoint's directory also holds the image processor's ``preprocessor_config.json``, so
``AutoProcessor`` / ``AutoImageProcessor`` load from it as from a released model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.tools.make_model import (BOS, DEFAULT_INIT_STD, EOS, PAD, SPECIAL_TOKENS, _init_weights, _quiet_transformers,
                                     build_tokenizer)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML with Qwen's image part: an {"type": "image"} part renders as one placeholder run.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ARCHS = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
}


def _text_config(arch: str, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict[str, Any]:
    head_dim = hidden // heads
    # The three rotary sections (temporal, height, width) split head_dim / 2 frequencies.
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if arch == "qwen3_vl":
        rope["mrope_interleaved"] = True
    cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters=rope,
               bos_token_id=SPECIAL_TOKENS.index(BOS), eos_token_id=SPECIAL_TOKENS.index(EOS),
               pad_token_id=SPECIAL_TOKENS.index(PAD), tie_word_embeddings=False)
    return cfg


def _vision_config(arch: str, hidden: int, out_hidden: int) -> dict[str, Any]:
    common = dict(depth=2, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2, out_hidden_size=out_hidden,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if arch == "qwen2_5_vl":  # block 1 attends over the whole image, block 0 within windows
        return dict(common, patch_size=14, window_size=56, fullatt_block_indexes=[1])
    # Qwen3-VL: learned position embeddings over a 4x4 grid, DeepStack features from block 0.
    return dict(common, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])


def make_vlm(out: str | Path, arch: str = "qwen2_5_vl", hidden_size: int = 64, num_layers: int = 2,
             num_heads: int = 4, num_kv_heads: int = 2, vision_hidden_size: int = 32, vocab_size: int = 512,
             seed: int = 0, max_pixels: int | None = None) -> Path:
    """Write a random-weight float32 VLM checkpoint with tokenizer and image processor to
    ``out``; returns its path. ``max_pixels`` bounds the processor's resize (small images keep
    their size, rounded to whole merged patches)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    config_name, model_name, processor_name = ARCHS[arch]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, 4096)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = len(tokenizer)
    config = getattr(transformers, config_name)(
        text_config=_text_config(arch, hidden_size, num_layers, num_heads, num_kv_heads, vocab),
        vision_config=_vision_config(arch, vision_hidden_size, hidden_size),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _init_weights(model, seed, DEFAULT_INIT_STD)  # make_model's scheme: clear greedy margins
    model.generation_config = GenerationConfig(bos_token_id=SPECIAL_TOKENS.index(BOS),
                                               eos_token_id=SPECIAL_TOKENS.index(EOS),
                                               pad_token_id=SPECIAL_TOKENS.index(PAD))
    patch = config.vision_config.patch_size
    merge = config.vision_config.spatial_merge_size
    image_processor = _image_processor(patch, merge, max_pixels)
    with _quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        image_processor.save_pretrained(out)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return out


def _image_processor(patch: int, merge: int, max_pixels: int | None) -> Any:
    """The image processor both families' releases name (Qwen2-VL's), with the model's patch and
    merge sizes; images are resized to whole merge units, at most ``max_pixels`` (default: 64
    merge units, so a test image has at most 64 placeholder tokens)."""
    from transformers import Qwen2VLImageProcessor

    unit = (patch * merge) ** 2
    size = {"shortest_edge": unit, "longest_edge": max_pixels or unit * 64}
    return Qwen2VLImageProcessor(patch_size=patch, merge_size=merge, temporal_patch_size=2, size=size)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagoda.tools.make_vlm OUT [--arch ...]``: a checkpoint for benchmarks."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2_5_vl")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--vision-hidden-size", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(make_vlm(a.out, a.arch, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.vision_hidden_size,
                   a.vocab_size, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
