"""LLaVA with a SigLIP vision tower: the SigLIP encoder's hidden states of chosen layers, through
the multi-modal projector (Linear-GELU-Linear), stand in for the prompt's ``<image>`` tokens of a
Llama or Qwen2 decoder (``decoder.py``) with plain 1-D rotary positions.

What the engine asks of it (``pagoda/multimodal/encoder_cache.py``):

- ``encode_image(pixels, grid_thw) -> [tokens, hidden_size]``: one image's projected features,
  one row per placeholder token. ``pixels`` are the image's patches ``[h * w, channels * p * p]``
  (the front end cut the processor's ``[3, H, W]`` into patches, row-major), ``grid_thw`` is
  ``(1, h, w)``.
- ``uses_mrope = False``: positions stay the token indices (no M-RoPE, no delta).
- ``forward(input_ids, positions, intermediate, mm=(rows, features))``: the decoder with the
  token embeddings of ``rows`` replaced by ``features``.

Which features: the hidden states after ``vision_feature_layer`` encoder layers (an index into
the embeddings-then-each-layer list, negative from its end; a list of them is concatenated
along the width), before the tower's final LayerNorm. ``vision_feature_select_strategy``
"default" drops the first row of each (a CLS position in towers that have one; SigLIP has none,
so it drops the first patch, as transformers does), "full" keeps all. Encoder layers past the
deepest one used, the final LayerNorm and SigLIP's pooling head are not built or loaded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.models.decoder import DecoderForCausalLM

SIGLIP = "siglip_vision_model"


def feature_layers(hf: dict) -> list[int]:
    """``vision_feature_layer`` as non-negative indices into the tower's hidden states
    (0: the embeddings, i: after encoder layer i)."""
    layers = hf.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    depth = hf["vision_config"]["num_hidden_layers"]
    out = [i if i >= 0 else depth + 1 + i for i in layers]
    if any(not 0 <= i <= depth for i in out):
        raise ValueError(f"vision_feature_layer {layers} lies outside a {depth}-layer vision tower")
    return out


def _gelu(name: str):
    approximate = "tanh" if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast") else "none"
    return lambda x: F.gelu(x, approximate=approximate)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, -1).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)
        self.act = _gelu(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm block: LayerNorm, attention, residual; LayerNorm, MLP, residual."""

    def __init__(self, vc: dict, dtype: torch.dtype) -> None:
        super().__init__()
        dim, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-6)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps, dtype=dtype)
        self.self_attn = SiglipAttention(dim, vc["num_attention_heads"], dtype)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps, dtype=dtype)
        self.mlp = SiglipMLP(dim, vc["intermediate_size"], vc.get("hidden_act", "gelu_pytorch_tanh"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    """Patch embedding (the stride-p convolution as one matrix product over the patches) plus a
    learned position per patch of the fixed ``image_size`` grid."""

    def __init__(self, vc: dict, dtype: torch.dtype) -> None:
        super().__init__()
        dim, p, c = vc["hidden_size"], vc["patch_size"], vc.get("num_channels", 3)
        self.patch_embedding = _ConvWeights(dim, c, p, dtype)
        self.position_embedding = nn.Embedding((vc["image_size"] // p) ** 2, dim, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.patch_embedding.weight
        x = F.linear(patches.to(w.dtype), w.view(w.shape[0], -1), self.patch_embedding.bias)
        return x + self.position_embedding.weight[:x.shape[0]]


class _ConvWeights(nn.Module):
    def __init__(self, dim: int, channels: int, patch: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, channels, patch, patch, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)


class SiglipVisionModel(nn.Module):
    """SigLIP's tower up to its ``depth``-th encoder layer; returns the hidden states at
    ``layers`` (indices as ``feature_layers``) joined along the width."""

    def __init__(self, vc: dict, layers: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.layers_out = layers
        self.embeddings = SiglipEmbeddings(vc, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(vc, dtype) for _ in range(max(layers)))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(patches)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return torch.cat([states[i] for i in self.layers_out], dim=-1)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, width: int, hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(width, hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.act = _gelu(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(DecoderForCausalLM):
    """The shared decoder (Llama's or Qwen2's flags), SigLIP as ``vision_tower``
    and the projector as ``multi_modal_projector``."""

    uses_mrope = False
    text_decode_is_plain = True  # a step without images is the decoder's own (the lean decode step)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        hf = cfg.hf_config
        vc = hf["vision_config"]
        if vc.get("model_type") != SIGLIP:
            raise ValueError(f"LLaVA checkpoints run with a SigLIP vision tower ({SIGLIP!r}); this one has "
                             f"{vc.get('model_type')!r}")
        layers = feature_layers(hf)
        self.drop_first = hf.get("vision_feature_select_strategy", "default") == "default"
        self.vision_tower = SiglipVisionModel(vc, layers, cfg.dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vc["hidden_size"] * len(layers), cfg.hidden_size, hf.get("projector_hidden_act", "gelu"),
            bool(hf.get("multimodal_projector_bias", True)), cfg.dtype)
        self._built_vision = {f"vision_tower.{n}" for n, _ in self.vision_tower.named_parameters()}

    # ---- checkpoint names ------------------------------------------------------------------
    @staticmethod
    def _canonical(name: str) -> str:
        """Both layouts onto pagoda's: ``model.language_model.*`` / ``model.vision_tower.*`` /
        ``model.multi_modal_projector.*`` (newer transformers) and ``language_model.model.*`` /
        ``language_model.lm_head.*`` / ``vision_tower.*`` (as first released); the tower's
        ``vision_model.`` level is written by some versions and not others."""
        name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def skip_weight(self, name: str) -> bool:
        """Tower weights this model does not use (layers past the deepest feature layer, the
        final LayerNorm, SigLIP's pooling head)."""
        name = self._canonical(name)
        return name.startswith("vision_tower.") and name not in self._built_vision

    def map_weight_name(self, name: str) -> tuple[str, object]:
        name = self._canonical(name)
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None
        for ckpt, (target, shard) in self.packed_modules.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{target}."), shard
        return name, None

    # ---- what the engine calls -------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's features ``[tokens, hidden_size]`` (see the module docstring)."""
        x = self.vision_tower(pixels)
        if self.drop_first:
            x = x[1:]
        return self.multi_modal_projector(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None,
                mm: tuple[torch.Tensor, torch.Tensor] | None = None):
        if mm is None:
            return self.model(input_ids, positions, intermediate)
        rows, features = mm
        x = self.model.embed_tokens(input_ids)
        x = x.index_copy(0, rows, features.to(x.dtype))
        return self.model(input_ids, positions, (x, None))
