"""Small pre-quantized checkpoints in each format's published layout, and the tests' own reader.

Writers take a dense random checkpoint (``pagoda.tools.make_model``), quantize its seven decoder
projections per layer, and store them exactly as the quantizers that define each format do:

* GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` int32 ``[in / (32/bits), out]``
  packed along the input dimension, least significant bits first; ``qzeros`` int32
  ``[groups, out / (32/bits)]`` packed along the output dimension; ``scales`` float16
  ``[groups, out]``; ``g_idx`` int32 ``[in]`` (the group of each input column; a permutation of
  ``i // group_size`` with ``desc_act``). ``checkpoint_format: gptq`` (v1, the classic one)
  stores every zero point minus one, applied by GPTQModel as a subtraction of ``0x11111111`` (4
  bits) / ``0x01010101`` (8 bits) from each packed word, so a zero point of 0 borrows from its
  neighbour and is undone by the matching addition; ``gptq_v2`` stores the zero points as they are.
  Dequantized: ``w[i, o] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``.
* AWQ GEMM (AutoAWQ, ``quant_method: awq``, ``version: gemm``): ``qweight`` int32
  ``[in, out / 8]`` packed along the output dimension in AutoAWQ's interleaved order: nibble ``i``
  of word ``c`` holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``qzeros`` int32
  ``[groups, out / 8]`` in the same order, no offset; ``scales`` float16 ``[groups, out]``.
* compressed-tensors ``pack-quantized`` (llm-compressor W4A16 / W8A16): ``weight_packed`` int32
  ``[out, in / (32/bits)]`` packed along the input dimension, each signed value stored plus
  ``2^(bits-1)``; ``weight_scale`` ``[out, groups]`` (``[out, 1]`` for the channel strategy);
  ``weight_shape`` int64 ``[out, in]``; asymmetric schemes add ``weight_zero_point`` (signed,
  stored the same way but packed along the output dimension: int32 ``[out / (32/bits), groups]``);
  ``actorder: group`` adds ``weight_g_idx``. Dequantized: ``(q - zero_point) * scale``.
* compressed-tensors ``float-quantized`` (FP8 / FP8_DYNAMIC): ``weight`` float8_e4m3fn ``[out,
  in]``, ``weight_scale`` ``[1]`` (tensor) or ``[out, 1]`` (channel); a static activation scheme
  adds ``input_scale``.
* FP8 with blocks (DeepSeek-V3, ``quant_method: fp8``, ``weight_block_size: [128, 128]``):
  ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale_inv`` float32
  ``[ceil(out/128), ceil(in/128)]``, multiplied in: ``w = weight * weight_scale_inv[block]``.
  Without ``weight_block_size`` the same ``quant_method`` has one float32 ``weight_scale`` per tensor.

The reader (``dequantize_checkpoint``) is written separately from the writers, from the same
descriptions, so the oracle does not share code with what it checks;
``oracle_model`` loads its output into Hugging Face ``transformers`` in float32.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing: nibble i holds column AWQ_ORDER[i]
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# A Llama small enough to test quickly whose input dimensions (128, 256) take groups of 32, 64
# and 128, and whose smallest output dimension (64, the K/V projections) packs eight 4-bit values.
MODEL_SHAPE = dict(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, vocab_size=512)


@dataclass(frozen=True)
class QuantSpec:
    """One checkpoint format and variant."""

    fmt: str  # gptq | awq | ct-int | ct-fp8 | fp8-block | fp8-tensor
    bits: int = 4
    group_size: int = 128  # -1: one group over the whole input dimension
    sym: bool = True
    desc_act: bool = False  # gptq: act-order g_idx; ct-int: actorder "group"
    checkpoint_format: str = "gptq"  # gptq: "gptq" (v1) or "gptq_v2"
    strategy: str = "group"  # ct-int: group | channel; ct-fp8: tensor | channel
    activations: str | None = None  # ct-fp8 / fp8: None | "dynamic" | "static"
    block: tuple[int, int] = (128, 128)
    config_in: str = "config.json"  # gptq: config.json | quantize_config.json | both
    extra: dict = field(default_factory=dict)  # merged into the quantization config (refusal tests)
    dense: tuple[str, ...] = ()  # projections (e.g. "down_proj") left unquantized in every layer
    mlp: "QuantSpec | None" = None  # ct-int/ct-fp8: a second config group for the MLP projections
    every_linear: bool = False  # fp8: every 2-D weight but embeddings, LM head and routers (DeepSeek-V3)

    @property
    def name(self) -> str:
        parts = [self.fmt, f"{self.bits}b"]
        if self.fmt in ("gptq", "awq", "ct-int"):
            parts.append(f"g{self.group_size}" if self.strategy == "group" else "channel")
        if self.fmt in ("gptq", "ct-int"):
            parts.append("sym" if self.sym else "asym")
        if self.desc_act:
            parts.append("actorder")
        if self.fmt == "gptq":
            parts.append(self.checkpoint_format)
            if self.config_in != "config.json":
                parts.append(self.config_in.replace(".json", ""))
        if self.fmt == "ct-fp8":
            parts.append(self.strategy)
        if self.fmt in ("ct-fp8", "fp8-tensor", "fp8-block"):
            parts.append(f"act-{self.activations}")
        if self.fmt == "fp8-block" or (self.fmt == "ct-fp8" and self.strategy == "block"):
            parts.append(f"blk{self.block[0]}x{self.block[1]}")
        if self.dense:
            parts.append("dense-" + "+".join(self.dense))
        if self.mlp is not None:
            parts.append("mlp=" + self.mlp.name)
        if self.every_linear:
            parts.append("every-linear")
        return "-".join(parts)

    def for_module(self, module: str) -> "QuantSpec | None":
        """The spec that quantizes ``module``; None leaves it dense."""
        leaf = module.rsplit(".", 1)[-1]
        if leaf in self.dense:
            return None
        if self.mlp is not None and leaf in ("gate_proj", "up_proj", "down_proj"):
            return self.mlp
        return self


# ----------------------------------------------------------------------------------- writers


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned values ``[rows, cols]`` along rows: word r holds rows r*k .. r*k+k-1, the
    first in the least significant bits (GPTQ ``qweight``)."""
    k = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // k, k, q.shape[1])
    words = sum(q[:, j] << (bits * j) for j in range(k))
    return _as_int32(words)


def _pack_cols(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned values ``[rows, cols]`` along columns; nibble j of word c holds column
    ``c*k + order[j]`` (identity order unless given)."""
    k = 32 // bits
    order = order or tuple(range(k))
    q = q.to(torch.int64).reshape(q.shape[0], q.shape[1] // k, k)
    words = sum(q[:, :, order[j]] << (bits * j) for j in range(k))
    return _as_int32(words)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_v1_offset(bits: int) -> int:
    return sum(1 << (bits * j) for j in range(32 // bits))  # 0x11111111 / 0x01010101


def _group_index(in_features: int, spec: QuantSpec, perm: torch.Tensor | None) -> torch.Tensor:
    size = in_features if spec.group_size == -1 else spec.group_size
    g_idx = torch.arange(in_features) // size
    if spec.desc_act:  # act order: column perm[i] is quantized i-th, in group i // size
        g_idx = torch.empty_like(g_idx).scatter_(0, perm, g_idx)
    return g_idx


def _int_quantize(w: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool,
                  signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest per (output row, group): codes ``[out, in]``, scales and zero points
    ``[out, groups]``, such that ``w ~ (q - z) * s``. Unsigned codes lie in [0, 2^bits - 1] and
    symmetric zero points are 2^(bits-1) (GPTQ, AWQ); signed codes and zero points lie in
    [-2^(bits-1), 2^(bits-1) - 1] with symmetric zero points 0 (compressed-tensors)."""
    groups = int(g_idx.max()) + 1
    out = w.shape[0]
    lo = torch.full((out, groups), float("inf")).scatter_reduce(1, g_idx.expand(out, -1), w, "amin")
    hi = torch.full((out, groups), float("-inf")).scatter_reduce(1, g_idx.expand(out, -1), w, "amax")
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    levels = 2**bits - 1
    qmin = -(2 ** (bits - 1)) if signed else 0
    if sym:
        scale = torch.maximum(-lo, hi) / (levels / 2)
        zero = torch.full_like(scale, 0 if signed else 2 ** (bits - 1))
    else:
        scale = (hi - lo) / levels
        zero = (qmin - lo / scale).round().clamp(qmin, qmin + levels)
    scale = scale.clamp(min=1e-8)
    return scale, zero, _codes(w, scale, zero, g_idx, qmin, qmin + levels)


def _codes(w, scale, zero, g_idx, qmin, qmax) -> torch.Tensor:
    s, z = scale[:, g_idx], zero[:, g_idx]
    return (w / s).round().add(z).clamp(qmin, qmax).to(torch.int32)


def _gptq(w: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    g_idx = _group_index(w.shape[1], spec, perm)
    scale, zero, q = _int_quantize(w, g_idx, spec.bits, spec.sym, signed=False)
    scale = scale.half().float()  # the checkpoint stores float16 scales
    q = _codes(w, scale, zero, g_idx, 0, 2**spec.bits - 1)
    packed_zeros = _pack_cols(zero.t().to(torch.int64), spec.bits).to(torch.int64)
    if spec.checkpoint_format == "gptq":
        packed_zeros = packed_zeros - _gptq_v1_offset(spec.bits)
    tensors = {"qweight": _pack_rows(q.t(), spec.bits), "qzeros": _as_int32(packed_zeros),
               "scales": scale.t().half().contiguous(), "g_idx": g_idx.to(torch.int32)}
    return tensors, (q - zero[:, g_idx]) * scale[:, g_idx]


def _awq(w: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    g_idx = _group_index(w.shape[1], spec, perm)
    scale, zero, _ = _int_quantize(w, g_idx, 4, sym=False, signed=False)
    scale = scale.half().float()
    q = _codes(w, scale, zero, g_idx, 0, 15)
    tensors = {"qweight": _pack_cols(q.t(), 4, AWQ_ORDER),
               "qzeros": _pack_cols(zero.t().to(torch.int64), 4, AWQ_ORDER),
               "scales": scale.t().half().contiguous()}
    return tensors, (q - zero[:, g_idx]) * scale[:, g_idx]


def _ct_int(w: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    if spec.strategy == "channel":
        g_idx = torch.zeros(w.shape[1], dtype=torch.int64)
    else:
        g_idx = _group_index(w.shape[1], spec, perm)
    scale, zero, _ = _int_quantize(w, g_idx, spec.bits, spec.sym, signed=True)
    scale = scale.bfloat16().float()  # llm-compressor keeps scales in the model's dtype (bf16)
    q = _codes(w, scale, zero, g_idx, -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1)
    offset = 2 ** (spec.bits - 1)
    tensors = {"weight_packed": _pack_cols(q + offset, spec.bits),
               "weight_scale": scale.bfloat16().contiguous(),
               "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not spec.sym:
        tensors["weight_zero_point"] = _pack_rows(zero.to(torch.int64) + offset, spec.bits)
    if spec.desc_act:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, (q - zero[:, g_idx]) * scale[:, g_idx]


def _fp8_scaled(w: torch.Tensor, scale_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = (w / scale_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, q.float() * scale_full


def _ct_fp8(w: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    if spec.strategy == "block":  # FP8_BLOCK: DeepSeek's layout under compressed-tensors' names
        tensors, deq = _fp8_block(w, spec, perm)
        return {"weight": tensors["weight"], "weight_scale": tensors["weight_scale_inv"]}, deq
    if spec.strategy == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)  # float32, as llm-compressor writes it
        q, deq = _fp8_scaled(w, scale)
    else:
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).bfloat16()
        q, deq = _fp8_scaled(w, scale.float())
    tensors = {"weight": q, "weight_scale": scale}
    if spec.activations == "static":
        tensors["input_scale"] = torch.tensor([0.05])
    return tensors, deq


def _fp8_block(w: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    bn, bk = spec.block
    out, inp = w.shape
    rows, cols = -(-out // bn), -(-inp // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:out, :inp] = w.abs()
    scale = padded.reshape(rows, bn, cols, bk).amax((1, 3)) / FP8_MAX
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out, :inp]
    q, deq = _fp8_scaled(w, full)
    return {"weight": q, "weight_scale_inv": scale.float()}, deq


def _fp8_tensor(w: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    scale = w.abs().max() / FP8_MAX
    q, deq = _fp8_scaled(w, scale)
    tensors = {"weight": q, "weight_scale": scale.reshape(())}
    if spec.activations == "static":
        tensors["input_scale"] = torch.tensor(0.05)
    return tensors, deq


_WRITERS = {"gptq": _gptq, "awq": _awq, "ct-int": _ct_int, "ct-fp8": _ct_fp8,
            "fp8-block": _fp8_block, "fp8-tensor": _fp8_tensor}


def quantization_config(spec: QuantSpec, dense_modules: list[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` the format's own tools write into config.json (naming the
    modules left dense the way each tool does)."""
    if spec.fmt == "gptq":
        cfg = {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size,
               "desc_act": spec.desc_act, "sym": spec.sym, "damp_percent": 0.01,
               "true_sequential": True, "static_groups": False, "lm_head": False,
               "checkpoint_format": spec.checkpoint_format, "model_name_or_path": None,
               "model_file_base_name": None, "pack_dtype": "int32",
               "meta": {"quantizer": ["gptqmodel:4.0.0"], "uri": "https://github.com/modelcloud/gptqmodel"}}
        if spec.dense:
            cfg["modules_in_block_to_quantize"] = [
                [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj") if p not in spec.dense],
                [f"self_attn.{p}" for p in ("o_proj",) if p not in spec.dense],
                [f"mlp.{p}" for p in ("gate_proj", "up_proj") if p not in spec.dense],
                [f"mlp.{p}" for p in ("down_proj",) if p not in spec.dense]]
    elif spec.fmt == "awq":
        cfg = {"quant_method": "awq", "bits": 4, "group_size": spec.group_size, "zero_point": True,
               "version": "gemm", "modules_to_not_convert": list(spec.dense) or None}
    elif spec.fmt in ("ct-int", "ct-fp8"):
        cfg = _ct_config(spec)
    else:
        cfg = {"quant_method": "fp8", "activation_scheme": spec.activations or "dynamic"}
        if spec.fmt == "fp8-block":
            cfg.update(fmt="e4m3", weight_block_size=list(spec.block))
        if dense_modules:
            cfg["ignored_layers"] = list(dense_modules)
    return {**cfg, **spec.extra}


def _ct_config(spec: QuantSpec) -> dict[str, Any]:
    fmt, group = _ct_group(spec)
    groups = {"group_0": group}
    if spec.mlp is not None:
        mlp_fmt, groups["group_1"] = _ct_group(spec.mlp)
        group["targets"] = [r"re:.*self_attn\.(q|k|v|o)_proj$"]
        groups["group_1"]["targets"] = [r"re:.*mlp\.(gate|up|down)_proj$"]
        fmt = fmt if mlp_fmt == fmt else "mixed-precision"
    ignore = ["lm_head"] + [rf"re:.*\.{d}$" for d in spec.dense]
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups,
            "ignore": ignore, "quantization_status": "compressed", "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {},
            "version": "0.20.0"}


def _ct_group(spec: QuantSpec) -> tuple[str, dict[str, Any]]:
    if spec.fmt == "ct-int":
        weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym, "dynamic": False,
                   "strategy": spec.strategy, "group_size": spec.group_size if spec.strategy == "group" else None,
                   "actorder": "group" if spec.desc_act else None, "block_structure": None,
                   "observer": "minmax", "observer_kwargs": {}}
        inputs, fmt = None, "pack-quantized"
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": spec.strategy, "group_size": None, "actorder": None,
                   "block_structure": list(spec.block) if spec.strategy == "block" else None,
                   "observer": "minmax", "observer_kwargs": {}}
        inputs, fmt = None, "float-quantized"
        if spec.activations == "dynamic":
            inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                      "strategy": "token", "group_size": None, "observer": None}
        elif spec.activations == "static":
            inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                      "strategy": "tensor", "group_size": None, "observer": "minmax"}
    return fmt, {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                 "output_activations": None, "format": fmt}


def write_quantized(dense_dir: Path, out: Path, spec: QuantSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write ``spec``'s checkpoint of ``dense_dir`` to ``out``; returns, per quantized module,
    the weight the writer meant to store (float32), for checking the reader against."""
    out.mkdir(parents=True, exist_ok=True)
    for path in dense_dir.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copy(path, out / path.name)
    gen = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    intended: dict[str, torch.Tensor] = {}
    dense_modules: list[str] = []
    for name, value in sorted(load_file(str(dense_dir / "model.safetensors")).items()):
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (module.rsplit(".", 1)[-1] in LINEARS or _every_linear(spec, name, value)):
            # GPTQ's act order sorts input columns by the Hessian of the layer's input, which
            # projections reading the same input (q/k/v, gate/up) share: so do their orders.
            key = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            if key not in perms:
                perms[key] = torch.randperm(value.shape[1], generator=gen)
            own = spec.for_module(module)
            if own is None:
                tensors[name], intended[module] = value, value.float()
                dense_modules.append(module)
                continue
            parts, intended[module] = _WRITERS[own.fmt](value.float(), own, perms[key])
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        else:
            tensors[name] = value
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(out, spec, dense_modules)
    return intended


def _every_linear(spec: QuantSpec, name: str, value: torch.Tensor) -> bool:
    """What DeepSeek-V3's fp8 checkpoints quantize: every matrix but the embeddings, the LM head
    and the expert routers (``mlp.gate``)."""
    return (spec.every_linear and value.dim() == 2 and not name.endswith("mlp.gate.weight")
            and "embed_tokens" not in name and "lm_head" not in name)


def _write_config(out: Path, spec: QuantSpec, dense_modules: list[str]) -> None:
    qcfg = quantization_config(spec, dense_modules)
    config = json.loads((out / "config.json").read_text())
    if spec.config_in in ("config.json", "both"):
        config["quantization_config"] = qcfg
    if spec.fmt in ("gptq", "awq"):
        config["torch_dtype"] = config["dtype"] = "float16"  # what these tools ship
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if spec.config_in in ("quantize_config.json", "both"):
        (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))


def make_quantized(root: Path, spec: QuantSpec, dense_dir: Path | None = None) -> tuple[Path, dict]:
    """A dense model (made here unless given) and its ``spec`` checkpoint under ``root``."""
    from pagoda.tools.make_model import make_model

    dense = dense_dir or make_model(root / "dense", **MODEL_SHAPE)
    out = root / spec.name
    return out, write_quantized(dense, out, spec)


# ------------------------------------------------------------------------------------- reader
# Written from the format descriptions above, sharing nothing with the writers.


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Every ``bits``-wide field of int32 words, least significant first, laid out along ``dim``
    (the fields of word ``w`` become positions ``w*k .. w*k+k-1``)."""
    k = 32 // bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(u >> (bits * j)) & (2**bits - 1) for j in range(k)], dim=dim + 1)
    shape = list(words.shape)
    shape[dim] *= k
    return fields.reshape(shape)


def _read_gptq(t: dict, cfg: dict) -> torch.Tensor:
    bits = cfg["bits"]
    q = _unpack_words(t["qweight"], bits, 0)  # [in, out]
    zeros_words = t["qzeros"].to(torch.int64)
    if cfg.get("checkpoint_format", "gptq") == "gptq":  # v1: every field stored minus one
        zeros_words = zeros_words + sum(1 << (bits * j) for j in range(32 // bits))
    zeros = _unpack_words(zeros_words, bits, 1)  # [groups, out]
    g = t["g_idx"].long()
    step = t["scales"].float()[g]
    return ((q - zeros[g]).float() * step).t(), step.t()


def _read_awq(t: dict, cfg: dict) -> torch.Tensor:
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits in nibble inverse[c]

    def unpack(words: torch.Tensor) -> torch.Tensor:
        fields = _unpack_words(words, 4, 1).reshape(words.shape[0], -1, 8)
        return fields[:, :, inverse].reshape(words.shape[0], -1)

    q, zeros = unpack(t["qweight"]), unpack(t["qzeros"])  # [in, out], [groups, out]
    size = q.shape[0] if cfg["group_size"] == -1 else cfg["group_size"]
    g = torch.arange(q.shape[0]) // size
    step = t["scales"].float()[g]
    return ((q - zeros[g]).float() * step).t(), step.t()


def _read_ct(t: dict, cfg: dict) -> torch.Tensor:
    """The scheme is read off the tensors (a checkpoint may mix schemes), except fp8 blocks."""
    if "weight_packed" not in t:  # float-quantized
        w, scale = t["weight"], t["weight_scale"]
        if scale.numel() == 1 or tuple(scale.shape) == (w.shape[0], 1):
            return w.float() * scale.float(), None
        blocks = [g["weights"]["block_structure"] for g in cfg["config_groups"].values()
                  if g["weights"].get("strategy") == "block"]
        return _read_fp8({"weight": w, "weight_scale_inv": scale}, {"weight_block_size": blocks[0]})
    out, inp = t["weight_shape"].tolist()
    bits = 32 * t["weight_packed"].shape[1] // inp
    offset = 2 ** (bits - 1)
    q = _unpack_words(t["weight_packed"], bits, 1)[:, :inp] - offset
    scale = t["weight_scale"].float()
    if "weight_zero_point" in t:
        zp = _unpack_words(t["weight_zero_point"], bits, 0)[:out] - offset
    else:
        zp = torch.zeros_like(scale)
    if "weight_g_idx" in t:
        g = t["weight_g_idx"].long()
    else:
        g = torch.arange(inp) // (inp // scale.shape[1])
    return (q - zp[:, g]).float() * scale[:, g], scale[:, g]


def _read_fp8(t: dict, cfg: dict) -> torch.Tensor:
    w = t["weight"].float()
    if "weight_scale_inv" not in t:
        return w * t["weight_scale"].float(), None
    bn, bk = cfg["weight_block_size"]
    s = t["weight_scale_inv"].float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w * s[: w.shape[0], : w.shape[1]], None


_QUANT_LEAVES = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv")
_READERS = {"gptq": _read_gptq, "awq": _read_awq, "compressed-tensors": _read_ct, "fp8": _read_fp8}


def read_quant_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in config:
        return config["quantization_config"]
    return {"quant_method": "gptq", **json.loads((model_dir / "quantize_config.json").read_text())}


def dequantize_checkpoint(model_dir: Path, steps: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, quantized modules replaced by their float32 ``weight``;
    ``steps`` (if given) receives each integer-quantized weight's per-element step (its scale)."""
    cfg = read_quant_config(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    dense: dict[str, torch.Tensor] = {}
    quantized = {n.rsplit(".", 1)[0] for n in tensors if n.rsplit(".", 1)[1] in _QUANT_LEAVES}
    for name, value in tensors.items():
        module, leaf = name.rsplit(".", 1)
        if (module in quantized or module.rsplit(".", 1)[-1] in LINEARS) and leaf != "bias":
            modules.setdefault(module, {})[leaf] = value
        else:
            dense[name] = value.float()
    for module, parts in modules.items():
        if set(parts) == {"weight"} and parts["weight"].dtype in (torch.float32, torch.float16, torch.bfloat16):
            dense[f"{module}.weight"] = parts["weight"].float()  # left unquantized
            continue
        weight, step = _READERS[cfg["quant_method"]](parts, cfg)
        dense[f"{module}.weight"] = weight.float().contiguous()
        if steps is not None and step is not None:
            steps[f"{module}.weight"] = step.contiguous()
    return dense


def oracle_model(model_dir: Path, weights: dict[str, torch.Tensor] | None = None,
                 through: Path | None = None) -> Any:
    """Hugging Face ``transformers`` in float32 on the checkpoint's dequantized weights (those of
    ``dequantize_checkpoint``, passed in if already computed). ``through``: write them there as
    a plain checkpoint and load that (for models whose transformers layout differs from the
    checkpoint's, such as fused experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = weights if weights is not None else dequantize_checkpoint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if through is not None:
        shutil.copytree(model_dir, through, ignore=shutil.ignore_patterns("*.safetensors", "quantize_config.json"))
        (through / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "dtype": "float32"}))
        save_file(weights, str(through / "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(str(through), dtype=torch.float32).eval()
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")})
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if config.get("tie_word_embeddings") and "lm_head.weight" not in weights:  # tied: one tensor, two names
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    model.load_state_dict(weights, strict=True)
    return model.eval()
