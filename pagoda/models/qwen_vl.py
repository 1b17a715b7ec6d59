"""Qwen2.5-VL and Qwen3-VL: a vision transformer whose merged patch features stand in for the
prompt's image placeholder tokens, and the shared decoder (``decoder.py``) with multimodal
rotary positions (M-RoPE, ``MRotaryEmbedding``) as the language model.

What the engine asks of a multimodal model (``pagoda/multimodal/encoder_cache.py`` calls it):

- ``encode_image(pixels, grid_thw) -> [tokens, feature_width]``: one image's features, one row
  per placeholder token. Qwen3-VL's rows also carry its DeepStack features (the main features
  first, then one ``hidden_size`` slice per DeepStack layer), so a row is all the decoder needs.
- ``mrope_positions(num_prompt_tokens, images) -> ([3, P] positions, delta)``: the prompt's
  (temporal, height, width) positions; text after the last image, and every generated token at
  index ``i``, sits at ``i + delta`` on all three axes.
- ``forward(input_ids, positions, intermediate, mm=(rows, features))``: the decoder with the
  token embeddings of ``rows`` replaced by ``features`` (and DeepStack features added after the
  first decoder layers); positions ``[T]`` or ``[3, T]``.

The vision tower is plain torch (``nn.Linear``, SDPA), replicated: tensor parallelism splits
only the decoder (and VLMs run on one rank for now, ``EngineConfig``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.layers.attention.backend import AttentionBackend
from pagoda.layers.norm_rope_act import MRotaryEmbedding, RMSNorm
from pagoda.layers.quantization import QuantizationConfig
from pagoda.models.decoder import DecoderForCausalLM, SelfAttention

# ---- vision tower pieces ------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Bidirectional attention of ``[N, H, D]`` rows within each segment ``bounds[i]..bounds[i+1]``."""
    n = q.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
    if len(bounds) <= 2:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        seg = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=q.device),
                                      torch.tensor(bounds, device=q.device).diff())
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg[:, None] == seg[None, :])
    return out.transpose(0, 1).reshape(n, -1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        return self.proj(_varlen_attention(q, k, v, bounds))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's vision MLP: SiLU-gated, with biases."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PlainVisionMLP(nn.Module):
    """Qwen3-VL's vision MLP: two layers with tanh-approximated GELU."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.linear_fc2 = nn.Linear(hidden, dim, dtype=dtype)
        self.approximate = "tanh" if "tanh" in act else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


def _patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(row, column) of each patch ``[N, 2]``, in the processor's order: merge-block by
    merge-block, row-major inside each block, repeated over frames."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    pos = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
    return pos.repeat(t, 1)


class VisionRotary(nn.Module):
    """2-D rotary of the vision tower: a quarter of each head's frequencies rotate by the patch's
    row, a quarter by its column; laid out (row, column) twice, rotate-half style."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        half = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half),
                             persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, rows' | columns' frequencies]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window attention over one image: the order of its merge units grouped by
    ``window x window`` windows of merge units (row-major windows, row-major inside), and the
    windows' bounds in patches."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = torch.arange(t * h * w).view(t, h, w)
    order, bounds = [], [0]
    for f in range(t):
        for r in range(0, h, window):
            for c in range(0, w, window):
                cell = index[f, r:r + window, c:c + window].flatten()
                order.append(cell)
                bounds.append(bounds[-1] + cell.numel() * merge * merge)
    return torch.cat(order), bounds


class Qwen2_5_VisionTransformer(nn.Module):
    """Qwen2.5-VL's vision tower: patch embedding, blocks with 2-D rotary (window attention
    except in ``fullatt_block_indexes``), RMSNorm, and the 2x2 patch merger to the decoder's width."""

    def __init__(self, vc: dict, dtype: torch.dtype) -> None:
        super().__init__()
        dim, heads = vc["hidden_size"], vc["num_heads"]
        self.patch, self.merge = vc["patch_size"], vc["spatial_merge_size"]
        self.window = vc["window_size"] // self.merge // self.patch
        self.full_blocks = set(vc.get("fullatt_block_indexes", ()))
        self.patch_embed = _PatchEmbed(vc, dtype, bias=False)
        theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // heads, theta)
        self.blocks = nn.ModuleList(
            VisionBlock(RMSNorm(dim, 1e-6, dtype), RMSNorm(dim, 1e-6, dtype), VisionAttention(dim, heads, dtype),
                        GatedVisionMLP(dim, vc["intermediate_size"], dtype)) for _ in range(vc["depth"]))
        self.merger = _Merger(dim, self.merge, vc["out_hidden_size"], RMSNorm(dim, 1e-6, dtype), dtype)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        unit = self.merge * self.merge
        x = self.patch_embed(pixels)
        order, windows = _window_order(grid, self.merge, self.window)
        patch_order = (order[:, None] * unit + torch.arange(unit)).flatten().to(x.device)
        x = x[patch_order]
        cos, sin = self.rotary(_patch_positions(grid, self.merge).to(x.device)[patch_order])
        frames = [i * grid[1] * grid[2] for i in range(grid[0] + 1)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        return self.merger(x)[torch.argsort(order.to(x.device))]


class _PatchEmbed(nn.Module):
    """The Conv3d patch embedding, as the matrix product it is (kernel = stride = one patch)."""

    def __init__(self, vc: dict, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.proj = _Conv3dWeights(vc, dtype, bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        bias = self.proj.bias if hasattr(self.proj, "bias") else None
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1), bias)


class _Conv3dWeights(nn.Module):
    def __init__(self, vc: dict, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        p, t = vc["patch_size"], vc["temporal_patch_size"]
        self.weight = nn.Parameter(torch.empty(vc["hidden_size"], vc.get("in_channels", 3), t, p, p, dtype=dtype),
                                   requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(vc["hidden_size"], dtype=dtype), requires_grad=False)


class _Merger(nn.Module):
    """Norm each patch, join each merge unit's patches into one row, then Linear-GELU-Linear."""

    def __init__(self, dim: int, merge: int, out: int, norm: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        width = dim * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(nn.Linear(width, width, dtype=dtype), nn.GELU(), nn.Linear(width, out, dtype=dtype))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


# ---- the model ----------------------------------------------------------------------------


def _mrope_rotary(cfg: ModelConfig) -> MRotaryEmbedding:
    hf = cfg.hf_config
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    sections = list(rope.get("mrope_section") or [])
    return MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.dtype, sections,
                            bool(rope.get("mrope_interleaved", False)))


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    """The shared decoder with M-RoPE, plus the vision tower as ``visual``."""

    # A step without images is the decoder's own (1-D positions, no image rows): the runner's
    # lean CPU decode step may run it.
    text_decode_is_plain = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        vc = cfg.hf_config["vision_config"]
        self.image_token_id = cfg.hf_config["image_token_id"]
        self.spatial_merge = vc["spatial_merge_size"]
        self.visual = self.make_vision(vc, cfg.dtype)

    @staticmethod
    def make_vision(vc: dict, dtype: torch.dtype) -> nn.Module:
        return Qwen2_5_VisionTransformer(vc, dtype)

    def make_attention(self, cfg: ModelConfig, backend: AttentionBackend, quant: QuantizationConfig | None,
                       prefix: str) -> nn.Module:
        return SelfAttention(cfg, backend, quant, prefix, rotary=_mrope_rotary(cfg))

    # ---- checkpoint names ------------------------------------------------------------------
    def map_weight_name(self, name: str) -> tuple[str, object]:
        """Both checkpoint layouts: ``model.layers`` / ``visual`` (as released) and
        ``model.language_model`` / ``model.visual`` (newer transformers)."""
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("model.visual."):
            name = name[len("model."):]
        if name.startswith("visual."):
            return name, None
        for ckpt, (target, shard) in self.packed_modules.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{target}."), shard
        return name, None

    # ---- what the engine calls -------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's features ``[tokens, feature_width]`` (see the module docstring)."""
        return self.visual(pixels, grid)

    def mrope_positions(self, num_prompt_tokens: int, images: list) -> tuple[torch.Tensor, int]:
        """M-RoPE positions of a prompt whose ``images`` (``ImageInput``s, in order) sit at their
        offsets: text runs count up on all three axes; an image's tokens take (start, start + row,
        start + column) over its merged grid, and the text after it resumes at start + the
        grid's larger side."""
        parts, pos, cursor = [], 0, 0
        for image in images:
            if image.offset > cursor:
                n = image.offset - cursor
                parts.append(torch.arange(pos, pos + n).expand(3, -1))
                pos += n
            merge = self.spatial_merge
            t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.reshape(3, -1) + pos)
            pos += max(h, w)
            cursor = image.end
        if num_prompt_tokens > cursor:
            parts.append(torch.arange(pos, pos + num_prompt_tokens - cursor).expand(3, -1))
            pos += num_prompt_tokens - cursor
        return torch.cat(parts, dim=1), pos - num_prompt_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None,
                mm: tuple[torch.Tensor, torch.Tensor] | None = None):
        if mm is None:
            return self.model(input_ids, positions, intermediate)
        rows, features = mm
        x = self.model.embed_tokens(input_ids)
        x = x.index_copy(0, rows, features[:, :x.shape[1]].to(x.dtype))
        return self.model(input_ids, positions, (x, None))


# ---- Qwen3-VL ---------------------------------------------------------------------------------


class _LayerNormMerger(nn.Module):
    """Qwen3-VL's patch merger: LayerNorm per patch (or, ``postshuffle``, over the joined merge
    unit, as the DeepStack mergers do), then Linear-GELU-Linear."""

    def __init__(self, dim: int, merge: int, out: int, dtype: torch.dtype, postshuffle: bool) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else dim, eps=1e-6, dtype=dtype)
        self.linear_fc1 = nn.Linear(self.width, self.width, dtype=dtype)
        self.linear_fc2 = nn.Linear(self.width, out, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """Qwen3-VL's vision tower: patch embedding plus a learned position table resampled
    (bilinear) to the image's grid, full-attention blocks with 2-D rotary and LayerNorms, the
    patch merger, and DeepStack mergers reading the outputs of ``deepstack_visual_indexes``
    blocks. Returns ``[tokens, (1 + deepstack) * out_hidden]``: merged features, then each
    DeepStack level's."""

    def __init__(self, vc: dict, dtype: torch.dtype) -> None:
        super().__init__()
        dim, heads, out = vc["hidden_size"], vc["num_heads"], vc["out_hidden_size"]
        self.merge = vc["spatial_merge_size"]
        self.patch_embed = _PatchEmbed(vc, dtype, bias=True)
        self.pos_embed = nn.Embedding(vc["num_position_embeddings"], dim, dtype=dtype)
        self.side = int(vc["num_position_embeddings"] ** 0.5)
        theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // heads, theta)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        self.blocks = nn.ModuleList(
            VisionBlock(nn.LayerNorm(dim, eps=1e-6, dtype=dtype), nn.LayerNorm(dim, eps=1e-6, dtype=dtype),
                        VisionAttention(dim, heads, dtype), PlainVisionMLP(dim, vc["intermediate_size"], dtype, act))
            for _ in range(vc["depth"]))
        self.merger = _LayerNormMerger(dim, self.merge, out, dtype, postshuffle=False)
        self.deepstack_indexes = list(vc.get("deepstack_visual_indexes") or [])
        self.deepstack_merger_list = nn.ModuleList(_LayerNormMerger(dim, self.merge, out, dtype, postshuffle=True)
                                                   for _ in self.deepstack_indexes)

    def _position_table(self, grid: tuple[int, int, int], pos: torch.Tensor) -> torch.Tensor:
        """The learned positions resampled to the grid (corners aligned), one row per patch."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        full = F.interpolate(table, size=(grid[1], grid[2]), mode="bilinear", align_corners=True)[0]
        return full.permute(1, 2, 0)[pos[:, 0], pos[:, 1]]

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        x = self.patch_embed(pixels)
        pos = _patch_positions(grid, self.merge).to(x.device)
        x = x + self._position_table(grid, pos).to(x.dtype)
        cos, sin = self.rotary(pos)
        frames = [i * grid[1] * grid[2] for i in range(grid[0] + 1)]
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_indexes:
                levels.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *levels], dim=-1)


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3's decoder (q/k norms) with interleaved M-RoPE, and DeepStack: the features of early
    vision blocks are added to the image rows' hidden states after the first decoder layers."""

    @staticmethod
    def make_vision(vc: dict, dtype: torch.dtype) -> nn.Module:
        return Qwen3VisionTransformer(vc, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None,
                mm: tuple[torch.Tensor, torch.Tensor] | None = None):
        if mm is None:
            return self.model(input_ids, positions, intermediate)
        rows, features = mm
        model, width = self.model, self.config.hidden_size
        x = model.embed_tokens(input_ids)
        x = x.index_copy(0, rows, features[:, :width].to(x.dtype))
        levels = features.shape[1] // width - 1
        residual = None
        for i, layer in enumerate(model.stage_layers):
            x, residual = layer(positions, x, residual)
            if i < levels:  # the layer's output is x + residual: add to its x part
                x = x.index_add(0, rows, features[:, (i + 1) * width:(i + 2) * width].to(x.dtype))
        x, _ = model.norm(x, residual)
        return x
