"""Random-weight vision-language checkpoints (Qwen2.5-VL, Qwen3-VL, LLaVA with a SigLIP tower)
for tests and benchmarks.

Like ``make_model``, the weights come from transformers' own config and model classes with
seeded values (``make_model._init_weights``'s scheme, which gives clear greedy margins), and the
tokenizer is ``make_model``'s locally trained BPE, here with Qwen's vision tokens added
(``<|vision_start|>``, ``<|image_pad|>``, ...) and a chat template that renders image parts. The
checkpoint's directory also holds the image processor's ``preprocessor_config.json``, so
``AutoProcessor`` / ``AutoImageProcessor`` load from it as from a released model.

LLaVA checkpoints (``llava_siglip``: a Llama decoder, features of the tower's last layer but one,
all patches kept; ``llava_siglip_qwen2``: a Qwen2 decoder, two feature layers joined, the first
row dropped as "default" does) use ``<image>`` as their placeholder and SigLIP's image processor
(a fixed square resize).
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

LLAVA_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")

# LLaVA variants: (text model_type, vision_feature_layer, vision_feature_select_strategy).
LLAVA = {"llava_siglip": ("llama", -2, "full"), "llava_siglip_qwen2": ("qwen2", [-3, -1], "default")}
LLAVA_IMAGE_SIZE, LLAVA_PATCH = 64, 16

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

    if arch in LLAVA:
        return _make_llava(out, arch, hidden_size, num_layers, num_heads, num_kv_heads, vision_hidden_size,
                           vocab_size, seed)
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted([*ARCHS, *LLAVA])}, got {arch!r}")
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


def _make_llava(out: str | Path, arch: str, hidden: int, layers: int, heads: int, kv_heads: int,
                vision_hidden: int, vocab_size: int, seed: int) -> Path:
    """A ``LlavaForConditionalGeneration`` checkpoint with a 2-layer SigLIP tower."""
    import torch
    from transformers import GenerationConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipImageProcessor

    text_type, feature_layer, strategy = LLAVA[arch]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, 4096)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    text = dict(model_type=text_type, vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 10000.0},
                bos_token_id=SPECIAL_TOKENS.index(BOS), eos_token_id=SPECIAL_TOKENS.index(EOS),
                pad_token_id=SPECIAL_TOKENS.index(PAD), tie_word_embeddings=False)
    vision = dict(model_type="siglip_vision_model", hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                  num_hidden_layers=2, num_attention_heads=2, image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH)
    patches = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2
    config = LlavaConfig(text_config=text, vision_config=vision,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=patches - (strategy == "default"), vision_feature_layer=feature_layer,
                         vision_feature_select_strategy=strategy, projector_hidden_act="gelu",
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _init_weights(model, seed, DEFAULT_INIT_STD)
    model.generation_config = GenerationConfig(bos_token_id=SPECIAL_TOKENS.index(BOS),
                                               eos_token_id=SPECIAL_TOKENS.index(EOS),
                                               pad_token_id=SPECIAL_TOKENS.index(PAD))
    image_processor = SiglipImageProcessor(size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE})
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
    p.add_argument("--arch", choices=sorted([*ARCHS, *LLAVA]), default="qwen2_5_vl")
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
