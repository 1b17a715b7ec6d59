"""GGUF tensor types (llama.cpp's block formats) on pagoda's integer kernels.

A GGUF file gives every tensor its own type, and the common "Q4_K_M" files mix them (Q4_K for
most matrices, Q6_K for some). Per linear layer pagoda keeps the weight quantized where its
type is an exact case of a kernel's format, and otherwise the loader dequantizes it to the
model dtype (``gguf.quants.dequantize``, the reference llama.cpp's Python package ships):

- ``Q4_0`` (blocks of 32: 4-bit codes, an fp16 scale ``d``, ``w = d * (q - 8)``), ``Q4_1``
  (``w = d * q + m``) and ``Q4_K`` (super-blocks of 256 holding eight sub-blocks of 32 with
  6-bit scales and mins, ``w = d * sc * q - dmin * mn``) are all 4-bit codes with one scale and
  one offset per 32 inputs: ``make_int4_linear`` with group size 32 and zero point
  ``-offset / scale``. Exact for Q4_0 and Q4_1 (their scales and offsets are float16 numbers, as
  the CPU kernel holds them); Q4_K's ``d * sc`` and ``dmin * mn`` are rounded to float16 there
  (within 2**-11 of each).
- ``Q8_0`` (blocks of 32 int8 codes with an fp16 scale) is ``make_int8_linear`` with group size
  32: exact, on a CPU the weight-only kernel's int8-in-groups kind (one byte per weight plus a
  float16 scale per 32, 1.0625 bytes; exact integer sums per group), on a GPU the Triton kernel.
- ``Q6_K`` (super-blocks of 256: sixteen sub-blocks of 16 with an int8 scale each, 6-bit
  codes, ``w = d * sc * (q - 32)``) is int8 in groups of 16 (``int8-g16``): the codes
  ``q - 32`` exactly, the group scale ``d * sc`` (exact in float32) rounded to float16 on a CPU
  (within 2**-11 of it), 1.125 bytes a weight. A layer fusing Q8_0 and Q6_K parts is ``int8-g16``
  too (each Q8_0 scale serves both halves of its block): exact in the same way.
- A fused layer (q/k/v, gate/up) stays exact when all its parts map to the same kernel; when
  its parts are all of the types above but differ otherwise (a Q4_K_M file's Q4_K q/k with a Q6_K
  v), the whole layer is requantized at load to int8 with one scale per output channel
  (``int8-channel``: ``scale = max|w_row| / 127``, round to nearest, from the float32 values
  ``gguf`` decodes; each output row keeps its own scale, so q and k lose no more than v). Lossy:
  a weight moves by at most half a step, ``max|w_row| / 254``. ``{"q6_k": "int8-channel"}``
  requantizes every Q6_K tensor so (one byte a weight), ``{"q6_k": "dequantize"}`` keeps them in
  the model dtype. Otherwise all of a fused layer's parts are dequantized.
- The LM head (``output.weight``, or ``token_embd.weight`` when the file ties them) takes the
  same rules (``GGUFHeadMethod``, reading its blocks from the file); the token embedding is a
  lookup of one row per token and stays dequantized.

Every other type (F32, F16, BF16, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, the IQ types gguf decodes) is
dequantized at load: exact in float32, one rounding in bfloat16/float16, and it costs the model
dtype's memory.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagoda.layers.quantization.base import LinearMethod, QuantizationConfig, WeightLoader, new_parameter
from pagoda.layers.quantization.layer_names import checkpoint_modules
from pagoda.layers.quantization.int_packed import check_groups
from pagoda.layers.quantization.kernels import QuantLinear, make_int4_linear, make_int8_linear
from pagoda.layers.quantization.online import quantize_int8

GROUP = 32
# GGUF tensor type -> the kernel that runs it quantized (exactly, up to float16 group scales).
KERNEL_KINDS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q8_0": "int8", "Q6_K": "int8-g16"}
# Requantized to int8 with one scale per output channel (lossy; see the module docstring).
CHANNEL = "int8-channel"
REQUANTIZED_TYPES = ("Q6_K",)
# The kernel kinds' groups of input columns (one scale, and for int4 one offset, each).
KIND_GROUPS = {"int4": GROUP, "int8": GROUP, "int8-g16": 16}
# The tensors (parameter suffixes) a kept layer loads: codes, scales and (int4) zero points.
KEPT_SUFFIXES = ("qweight", "scales", "zeros")


# What a Q6_K tensor becomes, set by ``--quantization-config '{"q6_k": ...}'`` with a GGUF file:
# "int8" (int8 in groups of 16, the default), "int8-channel" (requantized per output channel, one
# byte a weight, lossy) or "dequantize" (exact, the model dtype's bytes).
Q6_K_CHOICES = ("int8", "int8-channel", "dequantize")


def kind_of(types: list[str], kinds: dict[str, str] = KERNEL_KINDS,
            requantized: tuple[str, ...] = REQUANTIZED_TYPES) -> str | None:
    """The kernel of a layer whose checkpoint parts have GGUF ``types``: the exact kernel they
    share (Q8_0 with Q6_K: ``int8-g16``), else ``int8-channel`` when every part is a ``kinds`` or
    ``requantized`` type, else None (dequantized)."""
    found = {kinds.get(t) for t in types}
    if len(found) == 1 and None not in found:
        return found.pop()
    if found == {"int8", "int8-g16"}:
        return "int8-g16"
    if types and all(t in kinds or t in requantized for t in types):
        return CHANNEL
    return None


def group_of(kind: str) -> int:
    """The input columns per scale of a kept layer of ``kind`` (0: one per output channel)."""
    return KIND_GROUPS.get(kind, 0)


class GGUFConfig(QuantizationConfig):
    """Built from ``{"quant_method": "gguf", "tensor_types": {module name: type name}}`` (module
    names are the Hugging Face ones, ``model.layers.0.self_attn.q_proj``) and, for the LM head,
    ``"lm_head": {"file": path, "tensor": GGUF name, "type": type name}``."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str], lm_head: dict[str, str] | None = None,
                 q6_k: str = "int8") -> None:
        if q6_k not in Q6_K_CHOICES:
            raise ValueError(f"a GGUF quantization_config's q6_k must be one of {', '.join(Q6_K_CHOICES)}, "
                             f"got {q6_k!r}")
        self.tensor_types = dict(tensor_types)
        self.lm_head = dict(lm_head) if lm_head else None
        self.q6_k = q6_k
        self.kinds = KERNEL_KINDS if q6_k == "int8" else {t: k for t, k in KERNEL_KINDS.items() if t != "Q6_K"}
        self.requantized = REQUANTIZED_TYPES if q6_k != "dequantize" else ()

    @classmethod
    def from_config(cls, config: dict[str, Any], from_checkpoint: bool) -> "GGUFConfig":
        types = config.get("tensor_types")
        if not isinstance(types, dict):
            raise ValueError("a GGUF quantization_config needs the file's tensor_types")
        head = config.get("lm_head")
        if head is not None and not (isinstance(head, dict) and {"file", "tensor", "type"} <= set(head)):
            raise ValueError("a GGUF quantization_config's lm_head names its file, tensor and type")
        return cls(types, head, config.get("q6_k", "int8"))

    def layer_kind(self, prefix: str) -> str | None:
        """The kernel of pagoda's layer ``prefix`` (``...qkv_proj``), or None (dequantized)."""
        return kind_of([self.tensor_types.get(m, "") for m in checkpoint_modules(prefix)], self.kinds,
                       self.requantized)

    def kept_kind(self, module: str) -> str | None:
        """The kernel the checkpoint module ``module`` (``...q_proj``) loads into, or None when
        the loader must dequantize it."""
        head, _, leaf = module.rpartition(".")
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("gate_up_proj", ("gate_proj", "up_proj"))):
            if leaf in parts:
                return self.layer_kind(f"{head}.{fused}")
        return self.layer_kind(module) if module in self.tensor_types else None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        kind = self.layer_kind(prefix)
        return GGUFLinearMethod(kind) if kind is not None else None

    def head_kind(self) -> str | None:
        """The kernel of the LM head, or None (dequantized to the model dtype)."""
        return kind_of([self.lm_head["type"]], self.kinds, self.requantized) if self.lm_head else None

    def get_lm_head_method(self) -> "GGUFHeadMethod | None":
        kind = self.head_kind()
        return GGUFHeadMethod(kind, self.lm_head) if kind is not None and self.lm_head else None

    def summary(self) -> dict[str, list[str]]:
        """Tensor type -> "int4" / "int8" / "int8-g16" / "int8-channel" / "dequantized", over the file's
        linear weights and the LM head."""
        out: dict[str, list[str]] = {}
        for module, qtype in self.tensor_types.items():
            out.setdefault(qtype, []).append(self.kept_kind(module) or "dequantized")
        if self.lm_head:
            out.setdefault(self.lm_head["type"], []).append(self.head_kind() or "dequantized")
        return out

    def __repr__(self) -> str:
        parts = []
        for qtype, ways in sorted(self.summary().items()):
            counts = {w: ways.count(w) for w in sorted(set(ways))}
            parts.append(f"{qtype}: " + ", ".join(f"{n} {w}" for w, n in counts.items()))
        return f"GGUFConfig({'; '.join(parts)})"


def kernel_linear(kind: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  dtype: torch.dtype) -> QuantLinear:
    """The matmul of a layer of ``kind`` from its loaded codes and scales (per group of
    ``group_of(kind)`` columns; int8-channel: ``scales`` ``[out]``)."""
    if kind == "int4":
        return make_int4_linear(q, scales, zeros, GROUP, dtype=dtype)
    if kind == CHANNEL:
        return make_int8_linear(q, scales)
    return make_int8_linear(q, scales, None, group_of(kind))


class GGUFLinearMethod(LinearMethod):
    """Codes ``qweight`` ``[out, in]`` (int8 for the int8 kinds, 0..15 for int4), ``scales`` and
    (int4) ``zeros`` ``[out, in / group_of(kind)]``: ``W = scales * (q - zeros)`` group by group;
    int8-channel: ``scales`` ``[out]``, ``W = scales[:, None] * q``."""

    exact_extents = True

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       output_partition_sizes: list[int], dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        code_dtype = torch.uint8 if self.kind == "int4" else torch.int8
        new_parameter(layer, "qweight", (out_features, in_features), code_dtype, weight_loader,
                      output_dim=0, input_dim=1)
        layer.gguf_dtype = dtype
        if self.kind == CHANNEL:  # one scale per whole row: a row-parallel rank copies them all
            new_parameter(layer, "scales", (out_features,), torch.float32, weight_loader, output_dim=0)
            return
        group = group_of(self.kind)
        check_groups(layer, in_features, group, "GGUF")
        groups = in_features // group
        new_parameter(layer, "scales", (out_features, groups), torch.float32, weight_loader,
                      output_dim=0, input_dim=1)
        if self.kind == "int4":
            new_parameter(layer, "zeros", (out_features, groups), torch.float32, weight_loader,
                          output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "qlinear"):
            return
        zeros = layer.zeros.data if self.kind == "int4" else None
        layer.qlinear = kernel_linear(self.kind, layer.qweight.data, layer.scales.data, zeros, layer.gguf_dtype)
        for name in ("qweight", "scales", "zeros"):
            if hasattr(layer, name):
                delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.qlinear(x, bias)


class GGUFHeadMethod:
    """The LM head of a GGUF file on the kernel its type maps to (``ParallelLMHead``'s
    ``quantize_with`` contract): the head loads its dense weight as usual (a tied head's token
    lookup reads it), then ``quantize`` reads this rank's vocabulary rows of the tensor's blocks
    from the file (memory-mapped) and builds the kernel from them, so the int4 and int8 kinds
    stay exact whatever the model dtype. Rows past the vocabulary (a rank's padding) are zero."""

    def __init__(self, kind: str, head: dict[str, str]) -> None:
        self.kind, self.file, self.tensor, self.qtype = kind, head["file"], head["tensor"], head["type"]

    def check_shape(self, layer: nn.Module, in_features: int) -> None:
        group = group_of(self.kind) or 1
        if in_features % group:
            raise ValueError(f"a GGUF {self.qtype} LM head needs a hidden size that is a multiple of {group}")

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> QuantLinear:
        import gguf

        reader = gguf.GGUFReader(self.file)
        t = next(t for t in reader.tensors if t.name == self.tensor)
        cols, start = int(t.shape[0]), layer.start
        end = min(start + layer.per_rank, layer.vocab_size)
        raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)[start:end]
        if self.kind == CHANNEL:
            q, scales = requantize_int8(dequantize_rows(raw, self.qtype, end - start, cols))
            zeros = None
        else:
            q, scales, zeros = decode_kernel_tensor(raw, self.qtype, end - start, cols, group_of(self.kind))
        pad = layer.per_rank - (end - start)
        if pad:
            q, scales = _pad_rows(q, pad), _pad_rows(scales, pad)
            zeros = _pad_rows(zeros, pad) if zeros is not None else None
        device = w.device
        return kernel_linear(self.kind, q.to(device), scales.to(device),
                             zeros.to(device) if zeros is not None else None, w.dtype)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows, *t.shape[1:]))])


# ----------------------------------------------------------------------------- block decoding


def _f16(block_bytes: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) as float32."""
    return np.ascontiguousarray(block_bytes).view(np.float16)[..., 0].astype(np.float32)


def _codes_scale_offset(data: np.ndarray, qtype: str, rows: int, cols: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(codes [rows, cols], scale [rows, cols/32], offset [rows, cols/32] or None)`` with
    ``w = scale * codes + offset`` (Q8_0: signed codes, no offset; Q6_K: signed codes, no
    offset, a scale per 16 columns)."""
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if qtype == "Q6_K":
        return _q6_k(raw, rows, cols)
    if qtype == "Q8_0":
        b = raw.reshape(rows, cols // 32, 34)
        return b[..., 2:].view(np.int8).reshape(rows, cols), _f16(b[..., 0:2]), None
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        b = raw.reshape(rows, cols // 32, head + 16)
        qs = b[..., head:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)
        d = _f16(b[..., 0:2])
        offset = -8.0 * d if qtype == "Q4_0" else _f16(b[..., 2:4])
        return codes, d, offset
    if qtype == "Q4_K":
        return _q4_k(raw, rows, cols)
    raise ValueError(f"GGUF type {qtype} has no integer-kernel mapping")


def _q4_k(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = raw.reshape(rows, cols // 256, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16].astype(np.uint16)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
    # Each 32-byte chunk holds two sub-blocks: the low nibbles, then the high ones.
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(rows, cols)
    scale = (d[..., None] * sc).reshape(rows, cols // 32)
    offset = -(dmin[..., None] * mn).reshape(rows, cols // 32)
    return codes, scale.astype(np.float32), offset.astype(np.float32)


def _q6_k(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, None]:
    # A super-block of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d.
    b = raw.reshape(rows, cols // 256, 210)
    ql, qh = b[..., :128].reshape(rows, -1, 2, 1, 64), b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    # Each half of 128 values: 64 low-nibble bytes give values 0-63 (low nibbles) and 64-127
    # (high nibbles); the 32 bytes of bit pairs give values 32 apart (bits 0-1, 2-3, 4-5, 6-7).
    low = np.concatenate([ql & 0xF, ql >> 4], axis=3).reshape(rows, -1, 2, 4, 32)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, cols)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    scale = (_f16(b[..., 208:210])[..., None] * sc).reshape(rows, cols // 16)
    return codes, scale, None


def dequantize_rows(data: np.ndarray, qtype: str, rows: int, cols: int) -> np.ndarray:
    """A GGUF tensor's ``[rows, cols]`` float32 values, as ``gguf.quants.dequantize`` decodes them."""
    import gguf
    from gguf import quants

    out = quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType[qtype])
    return np.asarray(out, dtype=np.float32).reshape(rows, cols)


def requantize_int8(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [rows, cols] int8, scales [rows] float32)`` of float32 ``w``, symmetric per row
    (``scale = max|w_row| / 127``, round to nearest): the ``int8-channel`` kind."""
    return quantize_int8(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))


def decode_kernel_tensor(data: np.ndarray, qtype: str, rows: int, cols: int, group: int = GROUP
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GGUF tensor of a ``KERNEL_KINDS`` type as ``(qweight, scales, zeros)`` for
    ``GGUFLinearMethod`` (``zeros`` None for the int8 kinds): ``W = scales * (q - zeros)`` per
    group (32, or 16 for Q6_K and a Q8_0 part of an ``int8-g16`` layer, its scales repeated) is
    exactly ``gguf.quants.dequantize``'s result. A group whose scale is 0 holds one value (its
    offset): its codes become 0 and it is written as ``|offset| * (0 - (-sign))``."""
    codes, scale, offset = _codes_scale_offset(data, qtype, rows, cols)
    if offset is None:
        if scale.shape[1] * group < cols:  # Q8_0's blocks of 32 in a layer of groups of 16
            scale = np.repeat(scale, cols // group // scale.shape[1], axis=1)
        return torch.from_numpy(codes.copy()), torch.from_numpy(np.ascontiguousarray(scale)), None
    flat = scale == 0
    if flat.any():
        codes = codes.reshape(rows, cols // 32, 32).copy()
        codes[flat] = 0
        codes = codes.reshape(rows, cols)
        scale = np.where(flat, np.abs(offset), scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(scale == 0, 0.0, -offset / np.where(scale == 0, 1.0, scale)).astype(np.float32)
    return (torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
            torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)), torch.from_numpy(zeros))
