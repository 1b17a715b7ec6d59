"""GGUF files (llama.cpp, Ollama, LM Studio) as pagoda checkpoints.

``find_gguf`` says whether a model path is a GGUF file (the path itself, or the only ``.gguf``
in a directory without ``config.json``). ``read_config`` builds the ``config.json``-equivalent
dict from the file's metadata (architecture, sizes, heads, rope, norms, context length, vocab,
special tokens) with a ``quantization_config`` naming every linear weight's tensor type (and
the LM head's tensor and type), so the rest of pagoda (``ModelConfig``, the quantization seam)
treats the file like any pre-quantized checkpoint. ``tensors`` streams the weights under their
Hugging Face names: kernel-mapped types as codes/scales/zeros, requantized layers
(``int8-channel``) as int8 codes with per-row scales (``layers/quantization/gguf_quant.py``),
everything else dequantized to float32 by ``gguf.quants.dequantize`` (the weight loaders cast
to the model dtype; the LM head's kernel reads its blocks from the file itself). llama.cpp
stores a Llama model's Q and K rows in the interleaved rotary order; they are permuted back here. The tokenizer and chat template come from the file's metadata through
``transformers`` (``load_tokenizer``) unless ``--tokenizer`` names another. Mixtures of experts
(Mixtral as ``llama`` with an ``expert_count``, ``qwen2moe``, ``qwen3moe``) have their stacked
expert tensors split per expert and are dequantized whole (pagoda's expert layers take float
weights only).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    import torch

    from pagoda.config import ModelConfig

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
# GGUF general.architecture -> (Hugging Face architecture, whether llama.cpp permuted Q/K rows).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),  # MixtralForCausalLM when it has experts (expert_count)
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
}
# GGUF tensor types pagoda reads (the others gguf-py knows are refused by name at start-up).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# Per-layer tensors: GGUF name part -> Hugging Face module path inside ``model.layers.N``.
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts ``[experts, out, in]``: one Hugging Face tensor per expert.
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names, or None for a Hugging Face directory. ``ValueError`` for a
    directory with several ``.gguf`` files or a split (multi-part) file."""
    p = Path(path)
    if p.is_file() and p.suffix == SUFFIX:
        found = p
    elif p.is_dir() and not (p / "config.json").is_file():
        files = sorted(p.glob(f"*{SUFFIX}"))
        if not files:
            return None
        if len(files) > 1:
            raise ValueError(f"{p} holds several GGUF files ({', '.join(f.name for f in files)}); "
                             "name the one to load")
        found = files[0]
    else:
        return None
    if _SPLIT_RE.search(found.name):
        raise ValueError(f"{found} is one part of a split GGUF; pagoda reads single-file GGUFs "
                         "(merge the parts with llama.cpp's `llama-gguf-split --merge`)")
    return found


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a Q or K projection from the half-split rotary layout (``transformers``, pagoda)
    to the interleaved one llama.cpp's Llama graph uses: pairs ``(i, i + d/2)`` become
    ``(2i, 2i + 1)`` within each head."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_unpermute(w: Any, n_head: int) -> Any:
    """The inverse of ``rope_permute`` (numpy arrays or torch tensors; rows only, so codes,
    scales and zero points of a quantized projection permute alike)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face tensor name of a GGUF tensor name; None for one pagoda does not know."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    m = _LAYER_RE.match(gguf_name)
    if m is not None and m.group(2) in EXPERT_NAMES:  # a template: "{e}" is the expert
        return f"model.layers.{m.group(1)}.mlp.experts.{{e}}.{EXPERT_NAMES[m.group(2)]}.{m.group(3)}"
    if m is None or m.group(2) not in LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"


# ------------------------------------------------------------------------------- metadata


def _reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError / struct errors / IndexError for a bad file
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: Any, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF file {path} lacks the metadata key {key}")
    return value


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (1e-06, not
    9.99999997e-07), so the config equals the one it was written from."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


def _arch(reader: Any, path: Path) -> tuple[str, str, bool]:
    name = _field(reader, "general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {name!r} ({path}) is not supported; pagoda reads GGUF "
                         f"architectures: {', '.join(ARCHITECTURES)}")
    return (name, *ARCHITECTURES[name])


def _rope_scaling(reader: Any, arch: str, rope_freqs: np.ndarray | None, theta: float,
                  head_dim: int) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if rope_freqs is not None:
        return llama3_scaling(rope_freqs, theta, head_dim)
    if kind in ("none", None) or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor),
                **({"original_max_position_embeddings": int(orig)} if orig else {})}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: none, linear, yarn, "
                     "and Llama 3's rope_freqs)")


# Llama 3.x rope scaling parameters llama.cpp's converter bakes into ``rope_freqs``.
_LLAMA3_CANDIDATES = [(lo, hi, ctx) for lo in (1.0,) for hi in (4.0,) for ctx in (8192, 4096, 16384, 32768)]


def llama3_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict:
    """Llama 3's rope scaling from the per-frequency divisors llama.cpp stores (``rope_freqs``):
    the published parameters whose divisors match, else a clear refusal."""
    freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(freqs.max())
    if freqs.shape[0] != inv.shape[0]:
        raise ValueError(f"rope_freqs has {freqs.shape[0]} entries; the head size {head_dim} needs {inv.shape[0]}")
    for low, high, ctx in _LLAMA3_CANDIDATES:
        wavelen = 2 * np.pi / inv
        smooth = np.clip((ctx / wavelen - low) / (high - low), 0.0, 1.0)
        expect = 1.0 / ((1 - smooth) / factor + smooth)
        if np.allclose(expect, freqs, rtol=1e-3, atol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": ctx}
    raise ValueError("the GGUF's rope_freqs do not match Llama 3 rope scaling; pagoda cannot run these "
                     "per-frequency factors")


def _tensor_info(reader: Any) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _check_types(tensors: dict[str, Any], path: Path) -> None:
    bad = sorted({t.tensor_type.name for t in tensors.values() if t.tensor_type.name not in SUPPORTED_TYPES})
    if bad:
        raise ValueError(f"GGUF file {path} holds tensor types pagoda does not read: {', '.join(bad)}; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")


def _eos_ids(reader: Any) -> list[int]:
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _torch_dtype(tensors: dict[str, Any]) -> str:
    """The "checkpoint dtype" the model dtype is chosen from (``--dtype auto``)."""
    names = {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2}
    if names <= {"F32"}:
        return "float32"
    if names <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"


def read_config(path: str | Path) -> dict:
    """The Hugging Face ``config.json`` equivalent of the GGUF file ``path``."""
    path = Path(path)
    reader = _reader(path)
    arch, hf_arch, _ = _arch(reader, path)
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if experts and arch == "llama":  # llama.cpp writes Mixtral as "llama" with experts
        hf_arch = "MixtralForCausalLM"
    tensors = _tensor_info(reader)
    _check_types(tensors, path)
    unknown = sorted(n for n in tensors if hf_name(n) is None and n != "rope_freqs.weight")
    if unknown:
        raise ValueError(f"GGUF file {path} ({arch}) holds tensors pagoda cannot place: {', '.join(unknown[:6])}")
    hidden = int(_require(reader, f"{arch}.embedding_length", path))
    heads = int(_require(reader, f"{arch}.attention.head_count", path))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"GGUF file {path} has no token_embd.weight")
    rope_freqs = tensors.get("rope_freqs.weight")
    hf: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": arch,
        "hidden_size": hidden, "num_hidden_layers": int(_require(reader, f"{arch}.block_count", path)),
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim, "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, None if rope_freqs is None else np.array(rope_freqs.data),
                                      theta, head_dim),
        "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(embd.shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader),
        "torch_dtype": _torch_dtype(tensors),
    }
    if experts:
        hf.update(_moe_config(reader, arch, experts, path))
    else:  # pagoda's expert layers load float weights only: a mixture of experts is dequantized whole
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        hf["quantization_config"] = {"quant_method": "gguf", "tensor_types": {
            hf_name(n)[: -len(".weight")]: t.tensor_type.name for n, t in tensors.items()
            if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) == 2},
            "lm_head": {"file": str(path), "tensor": head, "type": tensors[head].tensor_type.name}}
    return hf


def _moe_config(reader: Any, arch: str, experts: int, path: Path) -> dict[str, Any]:
    """Expert counts and sizes; every layer is a mixture of experts (as llama.cpp builds them).
    Top-k weights renormalized as llama.cpp's graphs do: Mixtral and Qwen3-MoE yes, Qwen2-MoE no."""
    inter = _field(reader, f"{arch}.expert_feed_forward_length") or _field(reader, f"{arch}.feed_forward_length")
    out = {"num_local_experts": experts, "num_experts": experts,
           "num_experts_per_tok": int(_require(reader, f"{arch}.expert_used_count", path)),
           "moe_intermediate_size": int(inter), "norm_topk_prob": arch != "qwen2moe",
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


# -------------------------------------------------------------------------------- weights


def tensors(cfg: "ModelConfig", quant_config: Any) -> Iterator[tuple[Path, str, "torch.Tensor"]]:
    """``(file, Hugging Face name, tensor)`` for every weight of the GGUF ``cfg.path``: layers
    the quantization config keeps as ``<module>.qweight/.scales/.zeros``, the rest as dequantized
    float32 ``<module>.weight`` / ``.bias``."""
    import torch
    from gguf import quants

    from pagoda.layers.quantization.gguf_quant import CHANNEL, decode_kernel_tensor, group_of, requantize_int8

    path = Path(cfg.path)
    reader = _reader(path)
    _, _, permuted = _arch(reader, path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:  # rope_freqs: folded into the config's rope scaling
            continue
        module = name.rpartition(".")[0]
        heads = None  # llama.cpp's Llama Q/K rows are in the interleaved rotary order
        if permuted and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = cfg.num_heads if module.endswith("q_proj") else cfg.num_kv_heads
        kind = quant_config.kept_kind(module) if quant_config is not None and len(t.shape) == 2 else None
        if kind is not None and kind != CHANNEL:
            parts = decode_kernel_tensor(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]),
                                         group_of(kind))
            for suffix, part in zip(("qweight", "scales", "zeros"), parts):
                if part is not None:
                    yield path, f"{module}.{suffix}", part if heads is None else rope_unpermute(part, heads)
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if heads is not None:
            arr = rope_unpermute(arr, heads)
        if kind == CHANNEL:  # requantized from the float32 values, one int8 scale per row
            q, scales = requantize_int8(arr)
            yield path, f"{module}.qweight", q
            yield path, f"{module}.scales", scales
            continue
        if "{e}" in name:  # stacked experts, one tensor each
            for e in range(arr.shape[0]):
                yield path, name.format(e=e), torch.from_numpy(np.array(arr[e]))
            continue
        if name.endswith("mlp.shared_expert_gate.weight") and arr.ndim == 1:
            arr = arr[None, :]  # llama.cpp stores the [1, hidden] gate as a vector
        yield path, name, torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())
    if quant_config is not None:
        logger.info("GGUF %s: %r", path.name, quant_config)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer (with its chat template) ``transformers`` builds from a GGUF's metadata."""
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
