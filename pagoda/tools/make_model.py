"""Random-weight test checkpoints for pagoda (`pagoda make-model`).

pagoda's correctness tests compare its greedy generations token-for-token with a
reference implementation, so they need real Hugging Face-format checkpoints
(config.json, safetensors, generation_config.json, tokenizer files) without any
network access.  This module builds them locally:

* the weights come from the transformers config/model classes of the requested
  architecture, re-initialised from ``seed`` with a scheme chosen so greedy
  decoding has clear argmax margins (see ``_init_weights``);
* the tokenizer is a byte-level BPE trained on Python standard-library source
  that ships with the interpreter, cached per vocabulary size.

Sizes worth knowing:

* tests: the defaults (hidden 64, 2 layers, vocab 512) build in well under a second;
* demo: ``demo_model_path()`` (hidden 256, 4 layers, vocab 2048), cached;
* bench: a ~70M-parameter Llama-shaped fp32 model for throughput benchmarks::

      pagoda make-model --arch llama --out /tmp/bench-model --hidden-size 768 \\
          --num-layers 8 --num-heads 12 --num-kv-heads 4 --intermediate-size 2048 \\
          --vocab-size 8192

  (a few seconds once the 8192-token tokenizer is cached; ~10 s the first time).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

# Bump whenever the output of make_model changes for the same arguments, so
# cached demo models and tokenizers are rebuilt instead of silently reused.
MAKER_VERSION = "v1"

ARCHS: dict[str, tuple[str, str]] = {
    # arch -> (transformers config class, transformers causal-LM class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM"),
}

# Small defaults for the mixture-of-experts and MLA keys (any of them can be overridden with
# `extra_config` / --config-overrides).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "llama4": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5),
}

DTYPES = ("float32", "float16", "bfloat16")

# Special tokens take the first ids, in this order, so bos=1 / eos=2 as in Llama.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, PAD, IM_START, IM_END)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte alphabet + specials

SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML: `<|im_start|>role\ncontent<|im_end|>\n`, optionally opening an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Init scales, chosen by measuring 48-token greedy runs (see `hf_greedy`):
# * transformers' default (0.02 everywhere) gives a median top1-top2 logit gap of ~0.04
#   with ~2% of steps under 1e-3, and near-uniform attention that sends some
#   archs into 1-2 token loops.
# * embeddings/lm_head at 0.3 put the final hidden state (RMS-normed, |h| ~ sqrt(hidden))
#   against rows of norm ~0.3*sqrt(hidden): logit spread ~2.4 at hidden 64, median
#   gap ~0.5, well under 1% of steps below 1e-3 (fp32 noise is ~1e-6).
# * projections at gain/sqrt(fan_in) keep each layer's contribution O(1); gain 1.5
#   (rather than 1.0) makes the output depend on context, so runs stay diverse
#   instead of cycling on a couple of tokens.
DEFAULT_INIT_STD = 0.3  # embeddings and lm_head
PROJ_GAIN = 1.5  # projections: std = gain / sqrt(fan_in)
# lm_head rows of the special tokens are shrunk to near zero so random models
# practically never emit </s> or ChatML markers on their own: greedy tests get
# full-length generations whether or not they ignore EOS.  (With tied
# embeddings this also shrinks their input rows, which the first RMSNorm undoes.)
SPECIAL_ROW_SCALE = 0.05
BIAS_STD = 0.2  # qwen2 q/k/v biases: large enough that dropping them changes outputs
NORM_NOISE = 0.1  # RMSNorm weights = 1 + N(0, NORM_NOISE) so a skipped norm is visible

DEMO_KWARGS: dict[str, Any] = dict(
    arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
    intermediate_size=688, vocab_size=2048, seed=0,
)
BENCH_KWARGS: dict[str, Any] = dict(
    arch="llama", hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4,
    intermediate_size=2048, vocab_size=8192, seed=0,
)

# Training text: ~600 KB reaches 8k tokens; larger vocabularies need ~100 chars per token.
CORPUS_CHARS = 600_000
CORPUS_CHARS_PER_TOKEN = 100


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """pagoda's cache root: $PAGODA_CACHE_DIR, else ~/.cache/pagoda (temp dir if unwritable)."""
    env = os.environ.get("PAGODA_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "pagoda"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        fallback = Path(tempfile.gettempdir()) / "pagoda-cache"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a unique temp file + rename so concurrent writers never expose partial files."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------- tokenizer


def _training_corpus(max_chars: int = CORPUS_CHARS) -> list[str]:
    """Deterministic offline text: stdlib sources in sorted order, capped at `max_chars`.

    Falls back to builtin docstrings on interpreters shipped without .py sources.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        chunks.append(text[: max_chars - total])
        total += len(chunks[-1])
    if total < max_chars // 10:
        import builtins

        chunks += [getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins))]
    return chunks


def _corpus_digest(chunks: Sequence[str]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:12]


def version_tag() -> str:
    """Names cached artefacts: maker version + tokenizer corpus (which depends on the interpreter)."""
    return f"{MAKER_VERSION}-{_corpus_digest(_training_corpus())}"


def _train_bpe(chunks: Sequence[str], vocab_size: int) -> "Any":
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # The Qwen2 pipeline (NFC + split regex + byte-level).  transformers rebuilds
    # qwen2 tokenizers with exactly this pipeline whatever tokenizer.json says, so
    # using it for every arch keeps tokenizer.json and AutoTokenizer in agreement.
    # Byte-level means every string is encodable; decode(encode(s)) == s for NFC text.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(chunks, trainer)
    return tok


def tokenizer_json(vocab_size: int) -> str:
    """Serialized byte-level BPE of `vocab_size` tokens, trained once per size and cached."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + special tokens)")
    chunks = _training_corpus(max(CORPUS_CHARS, CORPUS_CHARS_PER_TOKEN * vocab_size))
    path = cache_dir() / f"tokenizer-bpe{vocab_size}-{MAKER_VERSION}-{_corpus_digest(chunks)}.json"
    if path.exists():
        return path.read_text(encoding="utf-8")
    text = _train_bpe(chunks, vocab_size).to_str()
    _atomic_write_text(path, text)
    return text


def build_tokenizer(vocab_size: int, model_max_length: int = 2048) -> "Any":
    """transformers tokenizer wrapping the cached BPE, with special tokens and a ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json(vocab_size)),
        unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        # Nothing may rewrite spaces on decode, or round-trips and detokenization diverge.
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --------------------------------------------------------------------------- model


def _default_intermediate(hidden_size: int) -> int:
    # Llama's ~8/3 expansion, rounded up to a multiple of 32.
    return -(-(8 * hidden_size // 3) // 32) * 32


def build_config(arch: str, hidden_size: int, num_layers: int, num_heads: int,
                 num_kv_heads: int | None, head_dim: int | None, intermediate_size: int | None,
                 vocab_size: int, tie_embeddings: bool, max_position_embeddings: int,
                 rope_theta: float, rope_scaling: dict | None, sliding_window: int | None = None,
                 extra_config: dict | None = None) -> "Any":
    """The transformers config object for `arch`."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    config_cls = getattr(transformers, ARCHS[arch][0])
    if head_dim is None and hidden_size % num_heads:
        raise ValueError("hidden_size must be divisible by num_heads unless head_dim is given")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or _default_intermediate(hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )
    # Full attention unless a window is asked for (Qwen's then start at max_window_layers, 0 by default).
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = sliding_window
    elif arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kwargs.update(sliding_window=sliding_window, use_sliding_window=sliding_window is not None,
                      max_window_layers=0)
    elif arch in ("gemma2", "gemma3", "phi3", "gpt_oss"):  # Gemma, gpt-oss: the window of its local layers
        kwargs["sliding_window"] = sliding_window
    kwargs.update(ARCH_DEFAULTS.get(arch, {}))
    kwargs.update(extra_config or {})
    if arch == "deepseek_v3":  # its rotary size is the rope part of the head: transformers reads head_dim
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    return config_cls(**kwargs)


def _init_weights(model: "Any", seed: int, init_std: float) -> None:
    """Overwrite every parameter from a seeded generator (see the scale notes at the top).

    Scheme: embeddings/lm_head ~ N(0, init_std) (special-token output rows
    shrunk by SPECIAL_ROW_SCALE); projections ~ N(0, PROJ_GAIN^2/fan_in);
    biases ~ N(0, BIAS_STD^2); RMSNorm weights ~ 1 + N(0, NORM_NOISE^2).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith(".bias"):
                value = noise * BIAS_STD
            elif name.endswith(".sinks"):  # attention sink logits (gpt-oss): spread so they matter
                value = noise
            elif param.dim() == 1:
                value = 1.0 + noise * NORM_NOISE
            elif "embed_tokens" in name or "lm_head" in name:
                value = noise * init_std
            else:  # fan-in is the last dim (stacked expert tensors are [experts, out, in])
                value = noise * (PROJ_GAIN / param.shape[-1] ** 0.5)
            if "lm_head" in name or ("embed_tokens" in name and model.config.tie_word_embeddings):
                value[: len(SPECIAL_TOKENS)] *= SPECIAL_ROW_SCALE
            param.copy_(value)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # routing bias: nonzero so it matters
                buf.copy_(torch.rand(buf.shape, generator=gen) * 0.2)


def _patch_config_json(out: Path, rope_theta: float, rope_scaling: dict | None, dtype: str) -> None:
    """Add the plain keys pagoda's loader reads, alongside transformers' own `rope_parameters`."""
    path = out / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    cfg["torch_dtype"] = dtype
    cfg.setdefault("dtype", dtype)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' per-save progress bars (tests make many models)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def make_model(out: str | Path, arch: str = "llama", hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int | None = None, head_dim: int | None = None,
               intermediate_size: int | None = None, vocab_size: int = 512,
               tie_embeddings: bool = False, dtype: str = "float32", seed: int = 0,
               max_position_embeddings: int = 2048, init_std: float | None = None,
               rope_scaling: dict | None = None, max_shard_size: str | None = None,
               rope_theta: float = 10000.0, sliding_window: int | None = None,
               extra_config: dict | None = None) -> Path:
    """Write a random-weight HF-format checkpoint + tokenizer to `out`; returns its path.

    Same arguments and seed give byte-identical safetensors.  `max_shard_size`
    (e.g. "200KB") splits the weights into model-0000x-of-0000y.safetensors
    with a model.safetensors.index.json.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, max_position_embeddings)
    config = build_config(arch, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                          intermediate_size, vocab_size, tie_embeddings,
                          max_position_embeddings, rope_theta, rope_scaling, sliding_window, extra_config)
    config.initializer_range = DEFAULT_INIT_STD if init_std is None else init_std
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(config)
    _init_weights(model, seed, DEFAULT_INIT_STD if init_std is None else init_std)
    model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a rerun with other sharding must not leave extra shards
    with _quiet_transformers():
        model.save_pretrained(out, max_shard_size=max_shard_size or "1000GB")
        tokenizer.save_pretrained(out)
    _patch_config_json(out, rope_theta, rope_scaling, dtype)
    for path in out.iterdir():
        if path.is_file():  # weights land via private temp files; a server may run as another user
            path.chmod(0o644)
    return out


# The trained demo models shipped as package data (`pagoda train-demo`, docs/demo-model.md).
BUILTIN_MODEL_ROOT = Path(__file__).resolve().parent.parent / "demo_model"


def builtin_model_path(kind: str = "main") -> Path | None:
    """The shipped trained model: "main" (served by default) or "draft" (its speculative
    draft); None when this install lacks it (e.g. a trimmed checkout)."""
    path = BUILTIN_MODEL_ROOT / kind
    return path if (path / "config.json").is_file() and any(path.glob("*.safetensors")) else None


def default_model_path() -> Path:
    """What `pagoda serve` / `LLM()` use with no model: the trained built-in model, or the
    random-weight demo model when the built-in one is not installed."""
    return builtin_model_path("main") or demo_model_path()


def demo_model_path() -> Path:
    """The cached random-weight demo model (Llama-shaped, ~4M params), built on first use.

    Built in a private temp dir and renamed into place, so concurrent callers
    either win the rename or find a complete model already there.
    """
    final = cache_dir() / f"demo-model-{version_tag()}"
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    try:
        make_model(tmp, **DEMO_KWARGS)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():  # lost to something other than a racing builder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------- test helpers


def read_checkpoint(model_dir: str | Path) -> dict[str, "Any"]:
    """All tensors of a (possibly sharded) safetensors checkpoint, by name."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def hf_greedy(model: "Any", prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Reference greedy decode with transformers, ignoring EOS.

    `model` is a loaded causal LM (or a checkpoint dir).  Returns the generated
    ids and, per step, the top1-top2 logit gap (how robust that argmax is).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    tokens: list[int] = []
    gaps: list[float] = []
    ids = torch.tensor([list(prompt_ids)])
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            outputs = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = outputs.past_key_values
            top2 = outputs.logits[0, -1].float().topk(2)
            tokens.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            ids = top2.indices[:1].view(1, 1)
    return tokens, gaps


# ---------------------------------------------------------------------------- CLI

_PRESETS: dict[str, dict[str, Any]] = {"demo": DEMO_KWARGS, "bench": BENCH_KWARGS}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so a --preset can fill whatever was not given explicitly.
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", choices=sorted(_PRESETS), help="demo or bench model shape")
    parser.add_argument("--arch", choices=sorted(ARCHS))
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--num-kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--tie-embeddings", action="store_true", default=None)
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument("--init-std", type=float)
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--rope-scaling", type=json.loads, help='JSON, e.g. \'{"rope_type":"linear","factor":2.0}\'')
    parser.add_argument("--max-shard-size", help='e.g. "2MB"; writes a sharded checkpoint')
    parser.add_argument("--sliding-window", type=int, help="attention window in tokens (mistral/qwen archs)")
    parser.add_argument("--config-overrides", dest="extra_config", type=json.loads,
                        help='JSON of config.json keys, e.g. \'{"num_local_experts": 8}\' (experts, MLA ranks)')


def run_cli(args: argparse.Namespace) -> int:
    """Handler for `pagoda make-model` (the parsed namespace from `_add_arguments`)."""
    names = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "intermediate_size", "vocab_size", "tie_embeddings", "dtype", "seed",
             "max_position_embeddings", "init_std", "rope_theta", "rope_scaling", "max_shard_size",
             "sliding_window", "extra_config")
    kwargs = dict(_PRESETS.get(args.preset or "", {}))
    kwargs.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    path = make_model(args.out, **kwargs)
    print(path)
    return 0


def add_cli(subparsers: "argparse._SubParsersAction") -> None:
    """Register `make-model`; the handler is stored as `func` on the parsed namespace."""
    parser = subparsers.add_parser(
        "make-model", help="write a random-weight test checkpoint with a local tokenizer",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_cli)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m pagoda.tools.make_model`."""
    parser = argparse.ArgumentParser(prog="python -m pagoda.tools.make_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
