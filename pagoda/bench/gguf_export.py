"""Write a Llama/Mistral/Qwen2/Qwen3 Hugging Face checkpoint as a GGUF file for llama.cpp, with
the ``gguf`` package directly (``pagoda bench peers`` runs llama.cpp and pagoda on the same file;
the tests write the GGUFs pagoda's own GGUF loader reads).

llama.cpp's own converter refuses tokenizers whose pre-tokenizer it does not recognise, and the
benchmark feeds token ids anyway, so the vocabulary is written as a plain byte-level BPE
(``gpt2`` model, ``default`` pre-tokenizer). Q and K projections are permuted into the rotary
layout llama.cpp's Llama graph expects (pairs ``(i, i + d/2)`` become ``(2i, 2i + 1)``), which is
what makes its greedy tokens equal to ``transformers``' on the same weights (Qwen models use
the half-split order in llama.cpp too and are written as they are). The tokenizer's chat
template, when it has one, goes into the metadata.

Precisions: ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``. 1-D tensors (norms, biases) stay
float32; with ``q8_0``/``q4_0`` every matrix is quantized, embeddings and output included, as
llama.cpp's converter does for those file types. ``tensor_types`` overrides the type of single
tensors (by GGUF name), as llama.cpp's mixed files (Q4_K_M) do; types gguf-py cannot quantize
(the K-quants) need an encoder from ``encoders``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from pagoda.models.gguf_loader import GLOBAL_NAMES, LAYER_NAMES, rope_permute, rope_unpermute

FTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# Hugging Face model_type -> GGUF architecture (llama.cpp writes Mistral as llama).
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                         "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# An expert's projection (Mixtral's w1/w3/w2 or gate/up/down_proj) -> its stacked GGUF tensor.
_EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
                 "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
# A tensor type gguf-py cannot quantize -> a function from float32 [rows, cols] to its raw bytes.
Encoder = Callable[[np.ndarray], np.ndarray]
__all__ = ["FTYPES", "SUPPORTED_MODEL_TYPES", "write_gguf", "read_gguf", "gguf_name", "hf_tensors",
           "llama3_rope_factors", "rope_permute", "rope_unpermute"]


def _qtype(ftype: str) -> Any:
    import gguf

    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
            "q4_0": gguf.GGMLQuantizationType.Q4_0}[ftype]


def _file_type(ftype: str) -> Any:
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[ftype]


_HF_TO_GGUF = {hf: g for g, hf in LAYER_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a Hugging Face Llama/Qwen tensor name."""
    fixed = {f"{hf}.weight": f"{g}.weight" for g, hf in GLOBAL_NAMES.items()}
    if hf_name in fixed:
        return fixed[hf_name]
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    layer, rest = parts[2], ".".join(parts[3:])
    stem, _, suffix = rest.rpartition(".")
    if stem not in _HF_TO_GGUF:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{layer}.{_HF_TO_GGUF[stem]}.{suffix}"


def hf_tensors(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of every tensor in the checkpoint's safetensors files."""
    import torch
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(torch.float32).numpy()


def _vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens (by id, padded to ``vocab_size``), their GGUF token types, and BPE merges."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # UNUSED
    for text, idx in tok["model"]["vocab"].items():
        if idx < vocab_size:
            tokens[idx], types[idx] = text, 1  # NORMAL
    for added in tok.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    return tokens, types, merges


def write_gguf(model_dir: str | Path, out_path: str | Path, ftype: str,
               tensor_types: dict[str, str] | None = None, encoders: dict[str, Encoder] | None = None) -> Path:
    """Write ``model_dir`` (a Llama/Mistral/Qwen2/Qwen3 checkpoint) as ``out_path`` in ``ftype``;
    ``tensor_types`` maps GGUF tensor names to other types (``"Q6_K"``), written with
    ``gguf.quants.quantize`` or, for the types it cannot write, ``encoders[type]``."""
    import gguf

    if ftype not in FTYPES:
        raise ValueError(f"ftype must be one of {', '.join(FTYPES)}; got {ftype!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"GGUF export handles {', '.join(SUPPORTED_MODEL_TYPES)}; got {cfg.get('model_type')!r}")
    arch = SUPPORTED_MODEL_TYPES[cfg["model_type"]]
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if (rope.get("rope_type") or "default") != "default" else None)
    rope_kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_kind not in ("default", "llama3") or (rope_kind == "llama3" and arch != "llama"):
        raise ValueError("GGUF export handles plain RoPE and Llama 3's rope scaling only")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_name(model_dir.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    _add_moe_metadata(w, cfg)
    w.add_file_type(_file_type(ftype))
    tokens, types, merges = _vocab(model_dir, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, adder in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                       ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            adder(cfg[key])
    w.add_add_bos_token(False)
    template = _chat_template(model_dir)
    if template:
        w.add_chat_template(template)

    qtype = _qtype(ftype)
    overrides = {k: gguf.GGMLQuantizationType[v] for k, v in (tensor_types or {}).items()}
    experts: dict[str, dict[int, np.ndarray]] = {}  # stacked GGUF name -> expert -> weight
    # A tied model has no lm_head tensor; llama.cpp then reads token_embd for the output too.
    for name, arr in hf_tensors(model_dir):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        stacked = _expert_target(name)
        if stacked is not None:
            experts.setdefault(stacked[0], {})[stacked[1]] = arr
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):
            arr = arr.reshape(-1)  # llama.cpp keeps Qwen2-MoE's [1, hidden] gate as a vector
        if arch == "llama" and ".self_attn.q_proj." in name:
            arr = rope_permute(arr, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            arr = rope_permute(arr, n_kv)
        target = gguf_name(name)
        _add(w, target, arr, overrides.get(target, qtype if arr.ndim == 2 else gguf.GGMLQuantizationType.F32),
             encoders or {})
    for target, per_expert in experts.items():
        arr = np.stack([per_expert[e] for e in range(len(per_expert))])
        _add(w, target, arr, overrides.get(target, qtype), encoders or {})
    if rope_kind == "llama3":  # llama.cpp's converter bakes it into per-frequency divisors
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, float(theta), head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _expert_target(hf_name: str) -> tuple[str, int] | None:
    """``(stacked GGUF name, expert)`` of a per-expert Hugging Face weight, else None."""
    parts = hf_name.split(".")
    if len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[4] == "experts" and parts[6] in _EXPERT_PARTS:
        return f"blk.{parts[2]}.{_EXPERT_PARTS[parts[6]]}.{parts[7]}", int(parts[5])
    return None


def _add_moe_metadata(w: Any, cfg: dict) -> None:
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return
    if cfg.get("mlp_only_layers") or (cfg.get("decoder_sparse_step") or 1) != 1:
        raise ValueError("GGUF export writes mixtures of experts whose every layer is sparse")
    w.add_expert_count(int(experts))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))


def llama3_rope_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.x rope scaling: per
    rotary frequency, what its angle is divided by (1 for short wavelengths, ``factor`` for long
    ones, a smooth blend between)."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * np.pi / theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (ctx / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, blended))
    return out.astype(np.float32)


def _chat_template(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer_config.json"
    template = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
    jinja = model_dir / "chat_template.jinja"
    return template if isinstance(template, str) else (jinja.read_text() if jinja.is_file() else None)


def _add(w: Any, name: str, arr: np.ndarray, qtype: Any, encoders: dict[str, Encoder]) -> None:
    import gguf
    from gguf import quants

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:  # rows not whole blocks: F16, as llama.cpp does
        qtype = gguf.GGMLQuantizationType.F16
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, arr)
    elif qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype.name in encoders:
        w.add_tensor(name, encoders[qtype.name](arr), raw_dtype=qtype)
    else:
        w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)


def read_gguf(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32, in the Hugging Face layout (names are GGUF's;
    quantized tensors dequantized; Q/K rows un-permuted), for checking an export."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    n_head = int(reader.fields[f"{arch}.attention.head_count"].contents())
    n_kv = int(reader.fields[f"{arch}.attention.head_count_kv"].contents())
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if arch == "llama" and ".attn_q." in t.name:
            arr = rope_unpermute(arr, n_head)
        elif arch == "llama" and ".attn_k." in t.name:
            arr = rope_unpermute(arr, n_kv)
        out[t.name] = arr
    return out
