"""Configuration: one frozen ``EngineArgs`` (user-facing, vLLM flag names) resolved once into
frozen per-concern configs. The CLI flags are generated from ``EngineArgs`` fields, so an option
is declared in exactly one place.

Importing this module does not import torch (the scheduler and the KV-cache manager read their
configs from here and stay torch-free): dtypes are resolved, and devices probed, when an
``EngineConfig`` is built."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.generation_config import generation_defaults
from pagoda.multimodal.options import DEFAULT_FETCH_TIMEOUT_S, MediaConfig
from pagoda.pooling import PoolerConfig, resolve_pooler

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# dtype names a user may give -> the torch dtype's attribute name.
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "half": "float16"}
# Quantized KV-cache dtypes (vLLM's --kv-cache-dtype names) -> the torch storage dtype; such a
# cache keeps one scale per token and K/V head beside it (layers/attention/kv_quant.py).
_KV_QUANT_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}

# Step budgets per device. A CPU forward is compute-bound already at a few hundred tokens, so a
# bigger budget only lengthens each step (and the stall a long prompt imposes on running
# streams); a GPU needs thousands of tokens per step to fill its cores.
CPU_MAX_NUM_BATCHED_TOKENS = 512
GPU_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_SEQS = 128
GPU_MAX_NUM_SEQS = 256
CPU_DEFAULT_KV_CACHE_MEMORY = 2 << 30
# Automatic multi-step decoding (``num_scheduler_steps`` unset): a round of decode steps lasts up
# to this long (the most a streamed token waits before it is sent; in the server a request or an
# abort that arrives mid-round ends the round at the next step), and has at most this many steps.
# The scheduler's and the output's fixed cost per round is then a small share of each step even
# where steps are short (a small model, a quantized one, a GPU).
AUTO_STEPS_BURST_S = 0.048
AUTO_MAX_STEPS = 32


def _opt(help: str, default: Any = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user can set on the engine; each field is also a ``--flag-name``."""

    model: str | None = _opt("Hugging Face model directory, or a GGUF file (or a directory holding one) "
                             "(default: the built-in demo model).")
    tokenizer: str | None = _opt("Tokenizer directory (default: the model directory; for a GGUF, the "
                                 "tokenizer and chat template in its metadata).")
    dtype: str = _opt("Weight and activation dtype: auto, float32, bfloat16, float16.", "auto")
    seed: int = _opt("Seed for sampling of requests that set no seed of their own.", 0)
    max_model_len: int | None = _opt("Context length (prompt + output); default (or -1): the model's. "
                                     "32k = 32000, 32K = 32768.")
    device: str = _opt("auto (CUDA when present, else CPU), cpu or cuda.", "auto")
    block_size: int = _opt("Tokens per KV-cache block.", 16)
    kv_cache_memory: int | None = _opt("Bytes of KV cache (CPU default 2 GiB; overrides the GPU profile).")
    gpu_memory_utilization: float = _opt("Fraction of GPU memory pagoda may use.", 0.9)
    kv_cache_dtype: str = _opt("KV cache dtype: auto (the model dtype), a float dtype name, or a quantized "
                               "cache: int8, fp8 (= fp8_e4m3), fp8_e5m2 (one scale per token and head).", "auto")
    max_num_seqs: int | None = _opt("Most sequences in one step (default per device).")
    max_num_batched_tokens: int | None = _opt("Token budget of one step (default per device).")
    enable_chunked_prefill: bool = _opt("Split long prompts over several steps.", True)
    long_prefill_token_threshold: int = _opt("Cap on one request's prefill chunk per step (0: none).", 0)
    enable_prefix_caching: bool = _opt("Reuse KV of shared prompt prefixes (radix tree).", True)
    mm_encoder_cache_bytes: int = _opt("Vision-language models: bytes of image features the encoder cache "
                                       "keeps by image content, so a repeated image is encoded once.", 256 << 20)
    max_num_encoder_tokens_per_step: int | None = _opt(
        "Vision-language models: most encoder input tokens (image patches, before the spatial merge) encoded "
        "in one step; a prompt chunk stops before an image that would pass it (cached images cost nothing; "
        "an image larger than the whole budget runs alone). Default: the step's token budget "
        "(max_num_batched_tokens).")
    scheduling_policy: str = _opt("fcfs; lpm (longest cached prefix first); or priority (the requests' "
                                  "priority field, lower first, then arrival; a waiting request may preempt "
                                  "running ones of a higher priority value).", "fcfs")
    max_queue_time: float | None = _opt(
        "Seconds a request may wait in the engine before it first runs; past that it is refused with 503 "
        "and Retry-After. Default: no limit.")
    max_request_output_tokens: int | None = _opt(
        "Most output tokens one request (one prompt) may ask for in all its samples: n x max_tokens "
        "(max_tokens unset counts as the rest of the context). A request over it is refused (400) "
        "before it runs. Default: no limit (fair shares between tenants bound what a big request costs "
        "the others).")
    background_holdoff: float = _opt(
        "Seconds the server's batch (background) requests stay paused after the last interactive "
        "request in the engine finished, so that a client's next request, a few milliseconds later, "
        "finds the engine idle instead of in a batch step (0: resume at once). The offline LLM never "
        "holds off.", 0.05)
    num_scheduler_steps: int | None = _opt(
        "Decode steps per scheduling round while every running sequence samples without logprobs, "
        "penalties, grammar or LoRA and no request waits: each step's tokens feed the next without a "
        "return to the scheduler, and their outputs arrive together. Default: as many as fit in "
        f"~{AUTO_STEPS_BURST_S * 1000:.0f} ms of decoding, up to {AUTO_MAX_STEPS}; 1 turns it off.")
    async_scheduling: bool = _opt(
        "Schedule the next step and build its inputs while the current step's forward pass runs (on a "
        "worker thread), each running decode assumed to get one more token (filled in from the sampled "
        "ids before the next forward); a step whose sequences finished is corrected afterwards, so "
        "outputs are those of the synchronous engine. Steps with drafts, a grammar, penalties, prompt "
        "logprobs, a pending min_tokens or a prompt forking into n samples run synchronously; so does the "
        "whole engine with tensor / pipeline parallelism, speculative decoding, LoRA, KV tiers, images or "
        "an embedding model. Multi-step decoding is off with it (num_scheduler_steps 1).", False)
    eviction_policy: str = _opt("Prefix-cache eviction: lru or lfu.", "lru")
    kv_offload_cpu_bytes: int | None = _opt(
        "Bytes of host memory for KV blocks evicted from the device cache (a tier below it: a prompt whose "
        "prefix was evicted loads it back instead of recomputing it). Default: no host tier.")
    kv_offload_disk_path: str | None = _opt(
        "Directory of a local-disk KV tier: every cached block is written there (one file per block, named "
        "by its content key), so an engine restarted on the same directory reuses them.")
    kv_offload_disk_bytes: int | None = _opt("Byte budget of the disk KV tier (default 16 GiB).")
    kv_offload_redis_url: str | None = _opt(
        "redis://HOST:PORT/DB of a Redis KV tier shared by every engine of the same model that names it "
        "(cached blocks are written through; Redis down means recomputation, never a failed request).")
    tensor_parallel_size: int = _opt("Number of tensor-parallel ranks.", 1)
    pipeline_parallel_size: int = _opt("Number of pipeline stages: the decoder layers are split into this many "
                                       "contiguous ranges, each on its own tensor-parallel group of ranks.", 1)
    enable_expert_parallel: bool = _opt("Mixture-of-experts layers: each tensor-parallel rank holds "
                                        "num_experts / tensor_parallel_size whole experts instead of a "
                                        "slice of every expert.", False)
    distributed_init_address: str = _opt("Rendezvous host for tensor parallelism (loopback by default).", "127.0.0.1")
    nnodes: int = _opt("Machines the engine's ranks are spread over, evenly (node 0 runs the scheduler and the "
                       "API; the others run only their worker ranks).", 1)
    node_rank: int = _opt("This machine's index, 0 .. nnodes - 1.", 0)
    dist_init_addr: str | None = _opt("HOST:PORT of node 0, where the nodes meet (required with nnodes > 1); "
                                      "node 0 listens there, on HOST only.")
    speculative_config: str | None = _opt("JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'.")
    enforce_eager: bool = _opt("Disable CUDA graphs.", False)
    quantization: str | None = _opt("Weight quantization: int8, int4 or fp8 (online, from a float checkpoint); "
                                    "default: the checkpoint's quantization_config, if any.")
    generation_config: str = _opt(
        "Where request sampling defaults come from, as vLLM's flag: auto (the model's generation_config.json: "
        "its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens stand for fields a request "
        "leaves unset), vllm (pagoda's own defaults), or a directory holding a generation_config.json.", "auto")
    override_generation_config: str | None = _opt(
        "JSON merged over those defaults, e.g. '{\"temperature\": 0.5}' (generation_config.json's key names).")
    quantization_config: str | None = _opt("JSON options of an online --quantization, e.g. "
                                           "'{\"group_size\": 64}' for int4; with a GGUF file "
                                           "'{\"q6_k\": \"dequantize\"}' keeps Q6_K tensors dense "
                                           "(default int8: int8 in groups of 16; int8-channel: "
                                           "requantized per channel, smaller and lossier).")
    max_logprobs: int = _opt("Most logprobs a request may ask for per position (logprobs, top_logprobs, "
                             "prompt_logprobs); the engine computes that many alternatives per token; -1: "
                             "the vocabulary, as vLLM's.", 20)
    structured_outputs_backend: str = _opt("Grammar library for structured output: auto (llguidance), guidance "
                                           "(llguidance) or xgrammar.", "auto")
    enable_lora: bool = _opt("Serve LoRA adapters (PEFT format) on top of the model.", False)
    max_loras: int = _opt("Most distinct LoRA adapters in one step (resident adapter slots).", 1)
    max_lora_rank: int = _opt("Largest LoRA rank an adapter may have.", 16)
    max_cpu_loras: int | None = _opt("Loaded LoRA adapters kept in host memory (default: max_loras).")
    load_format: str = _opt("auto (the checkpoint's safetensors weights) or dummy (random weights made in place, "
                            "no weight files read: for speed measurements; the directory needs only config.json "
                            "and a tokenizer).", "auto")
    task: str = _opt("auto, generate or embed: embed serves the model for /v1/embeddings (final hidden states "
                     "pooled per prompt, no generation); auto embeds when the checkpoint has sentence-transformers "
                     "files (modules.json with a Pooling module).", "auto")
    runner: str = _opt("auto, generate or pooling (pooling: the same as --task embed).", "auto")
    pooling_type: str | None = _opt("Embedding models: LAST, MEAN or CLS (default: the checkpoint's "
                                    "sentence-transformers Pooling config, else LAST).")
    normalize: bool | None = _opt("Embedding models: scale embeddings to unit L2 norm (default: whether the "
                                  "checkpoint has a sentence-transformers Normalize module; yes without one).")
    # Hub names (pagoda/models/hub.py), vLLM's flags.
    revision: str | None = _opt("Hub models: the branch, tag or commit to load (default: the default branch).")
    tokenizer_revision: str | None = _opt("Hub tokenizers (--tokenizer ORG/NAME): the branch, tag or commit.")
    download_dir: str | None = _opt("Hub models: the cache folder to download into and load from (default: "
                                    "huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub).")
    hf_token: str | None = field(default=None, repr=False, metadata={
        "help": "Hub token for gated or private models (default: $HF_TOKEN, or the token `hf auth login` saved)."})
    # Images in requests (pagoda/multimodal), vLLM's flags.
    allowed_media_domains: list[str] | None = _opt(
        "Hosts whose http(s) image URLs the server may fetch (exact host names, e.g. upload.wikimedia.org); "
        "default: none, so the server fetches nothing and images come as data: URLs.", nargs="+")
    allowed_local_media_path: str | None = _opt(
        "Directory whose files requests may name as images (file:// URLs or absolute paths; symlinks are "
        "resolved first and must stay inside). Default: no local files.")
    limit_mm_per_prompt: str | None = _opt(
        "JSON, most items per prompt of each modality, e.g. '{\"image\": 4}' (default 999 each).")
    media_fetch_timeout: float = _opt("Seconds one image URL may take to fetch, redirects included.",
                                      DEFAULT_FETCH_TIMEOUT_S)
    enable_sleep_mode: bool = _opt("Allow sleep (level 1 releases the KV cache, level 2 the weights too), wake "
                                   "and weight reloads from a checkpoint directory (the server's /sleep, "
                                   "/wake_up, /update_weights, /reset_prefix_cache). One process only: no "
                                   "tensor or pipeline parallelism, LoRA or speculative decoding.", False)

    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:  # type: ignore[misc]
        """Add one ``--flag`` per field to ``parser`` (booleans get ``--no-`` forms)."""
        for f in dataclasses.fields(EngineArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help")}
            if f.type in ("bool", bool, "bool | None"):
                kw["action"] = argparse.BooleanOptionalAction
            elif f.type in ("int", "int | None"):
                kw["type"] = integer
            elif f.type in ("float", "float | None"):
                kw["type"] = float
            if "nargs" in f.metadata:  # a list: repeated flags add to it
                kw.update(nargs=f.metadata["nargs"], action="extend")
            parser.add_argument(flag, dest=f.name, **kw)

    add_cli_args = staticmethod(add_cli_args)  # type: ignore[assignment]

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    def replace(self, **changes: Any) -> "EngineArgs":
        return dataclasses.replace(self, **changes)


def integer(text: str) -> int:
    """An integer flag's value (argparse names the type after this function): plain ints and
    sizes like ``2GiB`` / ``512MiB`` (for ``--kv-cache-memory``), and vLLM's short forms:
    ``32k`` = 32000, ``32K`` = 32768 (m / M, g / G alike)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    short = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    stripped = text.strip()
    if stripped[-1:] in short:
        return int(float(stripped[:-1]) * short[stripped[-1]])
    return int(low)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from its ``config.json``."""

    path: str
    tokenizer: str
    architecture: str
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Weight quantization (pagoda/layers/quantization): the method, its options, and whether
    # they come from the checkpoint (pre-quantized) or the user (online).
    quantization: str | None = None
    quantization_config: dict | None = None
    quantized_checkpoint: bool = False
    # Per layer: the sliding attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    # "auto": weights from the checkpoint's safetensors files; "dummy": random, made in place.
    load_format: str = "auto"
    # Served for embeddings (``EngineConfig.pooler``): the LM head is never used, and a
    # checkpoint may lack it (Qwen3-Embedding ships only the decoder).
    embedding_only: bool = False
    # Request sampling defaults from the model's generation config (``--generation-config``):
    # SamplingParams field names (max_new_tokens as max_tokens) -> values; empty: pagoda's own.
    generation_defaults: dict = field(default_factory=dict, compare=False, hash=False)
    # The checkpoint's config.json as read: architecture-specific keys (experts, MLA ranks)
    # are read from it by the model that needs them.
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @staticmethod
    def from_pretrained(path: str, tokenizer: str | None, dtype: str, max_model_len: int | None,
                        device: str, quantization: str | None = None,
                        quantization_config: str | dict | None = None) -> "ModelConfig":
        from pagoda.models import gguf_loader
        from pagoda.models.registry import resolve_architecture

        gguf_file = gguf_loader.find_gguf(path)
        if gguf_file is not None:  # a llama.cpp file: its metadata stands in for config.json
            path, hf = str(gguf_file), gguf_loader.read_config(gguf_file)
        else:
            cfg_path = Path(path) / "config.json"
            if not cfg_path.is_file():
                raise FileNotFoundError(f"model directory {path!r} has no config.json")
            try:
                hf = json.loads(cfg_path.read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"{cfg_path} is not valid JSON: {exc}") from exc
            if not isinstance(hf, dict):
                raise ValueError(f"{cfg_path} must hold a JSON object, got {type(hf).__name__}")
            hf = _with_text_config(hf)
        source = path if gguf_file is not None else str(Path(path) / "config.json")
        _check_shape_keys(hf, source)
        arch = resolve_architecture(hf.get("architectures") or [])
        flags = arch.flags_from(hf)
        heads = hf["num_attention_heads"]
        head_dim = arch.head_dim_from(hf) or hf.get("head_dim") or hf["hidden_size"] // heads
        rope_params = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if not _is_number(rope_theta):
            raise ValueError(f"{source}: rope_theta must be a number, got {rope_theta!r}")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("mrope", "default"):
            rope_scaling = None  # multimodal rotary sections (read by the model) over plain frequencies
        max_pos = hf.get("max_position_embeddings", 2048)
        if max_model_len == -1 and type(max_model_len) is int:
            max_model_len = None  # vLLM's -1: the model's own
        if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if max_model_len is None:
            max_model_len = max_pos
        elif max_model_len > max_pos:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_pos}")
        return ModelConfig(
            path=str(path), tokenizer=str(tokenizer or path), architecture=arch.name,
            dtype=_resolve_dtype(dtype, hf.get("torch_dtype") or hf.get("dtype"), device),
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=hf["intermediate_size"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta), rope_scaling=rope_scaling, max_position_embeddings=max_pos,
            max_model_len=max_model_len, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"], o_bias=flags["o_bias"], qk_norm=flags["qk_norm"],
            eos_token_ids=_eos_ids(path, hf), bos_token_id=hf.get("bos_token_id"),
            **_resolve_quantization(path, hf, quantization, quantization_config),
            sliding_windows=arch.windows_from(hf), hf_config=hf,
        )

    @property
    def is_multimodal(self) -> bool:
        """Whether the model takes images (``LLM.generate`` with ``multi_modal_data``,
        ``pagoda/multimodal``)."""
        from pagoda.models.registry import ARCHITECTURES

        return ARCHITECTURES[self.architecture].multimodal

    @property
    def is_hybrid(self) -> bool:
        """Whether the model has recurrent (Mamba) layers beside attention: each running
        sequence holds a recurrent-state slot, and prompts reuse no cached prefix."""
        from pagoda.models.registry import ARCHITECTURES

        return ARCHITECTURES[self.architecture].hybrid_from(self.hf_config)

    @property
    def num_params(self) -> int:
        """Parameters the model holds (every expert of a mixture of experts)."""
        from pagoda.models.param_count import count_params

        return count_params(self).total

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: a mixture of experts runs only its top-k routed experts."""
        from pagoda.models.param_count import count_params

        return count_params(self).active


# config.json keys every decoder's shapes come from: positive integers (``intermediate_size``
# and the optional ones may be absent where an architecture has no use for them).
_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SHAPE_KEYS = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_shape_keys(hf: dict, source: str) -> None:
    """A clear error naming the key and the file for a missing or non-positive shape, rather
    than a KeyError or a division by zero further in."""
    for key in _SHAPE_KEYS + _OPTIONAL_SHAPE_KEYS:
        value = hf.get(key)
        if value is None and key not in _SHAPE_KEYS:
            continue
        if value is None:
            raise ValueError(f"{source} has no {key}")
        if type(value) is not int or value < 1:
            raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _with_text_config(hf: dict) -> dict:
    """A multimodal checkpoint's config.json with its language model's keys (``text_config``) at
    the top, as a text model's are (the top-level ``architectures`` kept); the vision keys stay
    where they are (a vision-language model reads them; one loaded text-only ignores them)."""
    text = hf.get("text_config")
    return {**hf, **text, "architectures": hf.get("architectures")} if isinstance(text, dict) else hf


# --quantization-config keys a GGUF file takes (docs/quantization.md, "GGUF files").
GGUF_LOAD_OPTIONS = frozenset({"q6_k"})


def _resolve_quantization(path: str, hf: dict, method: str | None, options: str | dict | None) -> dict:
    """``quantization``, ``quantization_config`` and ``quantized_checkpoint`` of a ModelConfig:
    the checkpoint's ``quantization_config`` (config.json, else ``quantize_config.json``, whose
    method defaults to gptq) wins; ``--quantization`` must then name the same method. Otherwise
    ``--quantization`` (with ``--quantization-config`` options) quantizes online. vLLM's kernel
    names of a checkpoint method (``awq_marlin``, ``gptq_marlin``) name the method itself."""
    if isinstance(method, str) and method.endswith("_marlin"):
        method = method[: -len("_marlin")]
    ckpt = hf.get("quantization_config")
    legacy = Path(path) / "quantize_config.json"
    if ckpt is None and legacy.is_file():
        ckpt = {"quant_method": "gptq", **json.loads(legacy.read_text())}
    if isinstance(options, str):
        try:
            options = json.loads(options) if options.strip() else None
        except ValueError as exc:
            raise ValueError(f"quantization_config is not valid JSON: {exc}") from None
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {options!r}")
    if ckpt is not None:
        if not isinstance(ckpt, dict) or not ckpt.get("quant_method"):
            raise ValueError(f"{path}: the checkpoint's quantization_config has no quant_method")
        ckpt_method = str(ckpt["quant_method"]).lower()
        if method is not None and method != ckpt_method:
            raise ValueError(f"the checkpoint {path} is quantized with {ckpt_method!r}; "
                             f"--quantization {method!r} cannot be applied to it")
        if options and ckpt_method == "gguf" and set(options) <= GGUF_LOAD_OPTIONS:
            ckpt = {**ckpt, **options}  # how a GGUF's tensor types load (e.g. q6_k), checked by GGUFConfig
        elif options:
            raise ValueError("--quantization-config applies to online quantization only (and to a GGUF file's "
                             f"{', '.join(sorted(GGUF_LOAD_OPTIONS))}); the checkpoint {path} is already "
                             f"quantized ({ckpt_method})")
        return {"quantization": ckpt_method, "quantization_config": ckpt, "quantized_checkpoint": True}
    if method is None:
        if options:
            raise ValueError("--quantization-config needs --quantization (int8, int4 or fp8)")
        return {}
    return {"quantization": method, "quantization_config": options or {}, "quantized_checkpoint": False}


def _eos_ids(path: str, hf: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = Path(path) / "generation_config.json"
    sources = [hf] + ([json.loads(gen.read_text())] if gen.is_file() else [])
    for src in sources:
        eos = src.get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return tuple(ids)


def _resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    import torch

    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return getattr(torch, _DTYPES[dtype])
    if device == "cpu":
        # A half-precision checkpoint runs in bfloat16 where the CPU has bfloat16 dot products
        # (AVX512-BF16 or AMX); elsewhere, and for float32 checkpoints, float32
        # (cpu_features.prefers_bf16).
        from pagoda.cpu_features import prefers_bf16

        if checkpoint_dtype in ("bfloat16", "float16") and prefers_bf16():
            return torch.bfloat16
        return torch.float32
    if checkpoint_dtype == "float32":
        return torch.bfloat16
    return getattr(torch, _DTYPES.get(str(checkpoint_dtype), "bfloat16"))


def _resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: the model's (auto), a float dtype, or int8/fp8 (quantized)."""
    import torch

    if name == "auto":
        return model_dtype
    if name in _DTYPES:
        return getattr(torch, _DTYPES[name])
    if name in _KV_QUANT_DTYPES:
        return getattr(torch, _KV_QUANT_DTYPES[name])
    raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_DTYPES)}, {', '.join(_KV_QUANT_DTYPES)}; "
                     f"got {name!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: block size, its memory budget (``kv_cache_memory`` bytes, else a GPU
    profile under ``gpu_memory_utilization``), its storage dtype (int8 and fp8 mean a quantized
    cache with per-token-head scales) and the prefix cache's settings."""

    block_size: int
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    kv_cache_dtype: torch.dtype
    enable_prefix_caching: bool
    eviction_policy: str
    offload: KVOffloadConfig | None = None  # KV tiers below the device pool (None: none)
    mm_encoder_cache_bytes: int = 256 << 20  # image features kept by image hash (vision-language models)


@dataclass(frozen=True)
class KVOffloadConfig:
    """KV-cache tiers below the device pool (``kvcache/tiers``): host memory (bytes), a disk
    directory (and its byte budget), a Redis URL; any may be unset."""

    cpu_bytes: int | None = None
    disk_path: str | None = None
    disk_bytes: int | None = None
    redis_url: str | None = None

    @staticmethod
    def from_args(args: "EngineArgs") -> "KVOffloadConfig | None":
        if not (args.kv_offload_cpu_bytes or args.kv_offload_disk_path or args.kv_offload_redis_url):
            if args.kv_offload_disk_bytes is not None:
                raise ValueError("kv_offload_disk_bytes needs kv_offload_disk_path")
            return None
        for name in ("kv_offload_cpu_bytes", "kv_offload_disk_bytes"):
            value = getattr(args, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if args.kv_offload_disk_bytes is not None and not args.kv_offload_disk_path:
            raise ValueError("kv_offload_disk_bytes needs kv_offload_disk_path")
        if not args.enable_prefix_caching:
            raise ValueError("the KV offload tiers (kv_offload_*) extend the prefix cache: they need "
                             "enable_prefix_caching")
        url = args.kv_offload_redis_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_offload_redis_url must be a redis://, rediss:// or unix:// URL, got {url!r}")
        return KVOffloadConfig(args.kv_offload_cpu_bytes, args.kv_offload_disk_path, args.kv_offload_disk_bytes, url)


@dataclass(frozen=True)
class SchedulerConfig:
    """Each step's limits (``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens),
    chunked prefill (``long_prefill_token_threshold`` caps one request's chunk; 0 none) and
    the waiting queue's order (``policy``: fcfs, lpm or priority) and how long a request may wait
    before it first runs (``max_queue_time`` seconds; None: no limit)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    policy: str
    max_loras: int = 0  # most distinct LoRA adapters in one step (0: LoRA off)
    num_scheduler_steps: int | None = None  # decode steps per round (None: chosen per step time)
    # Schedule step N + 1 while step N runs (``engine/async_scheduling.py``).
    async_scheduling: bool = False
    max_request_output_tokens: int | None = None  # n x max_tokens allowed per request (None: any)
    max_queue_time: float | None = None
    # Image patches encoded per step (vision-language models; None: no limit).
    max_num_encoder_tokens_per_step: int | None = None
    # With several tenants, each tenant decodes at most its share of ``max_num_seqs`` sequences
    # a step (the rest of its running sequences wait a step, the least advanced first). On by
    # default on CPU, where a step's time grows with its sequences, so one tenant's batch would
    # otherwise set every other tenant's time per token; off on a GPU, where a decode step costs
    # about the same for any batch and the cap would only lose throughput.
    fair_step_share: bool = False
    # Seconds background requests stay paused after interactive work ends (the server's engine
    # only: ``EngineCore.abandon_background_when``).
    background_holdoff: float = 0.0


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel ranks and the host of their rendezvous; with ``nnodes`` > 1 the ranks are
    spread evenly over that many machines, ``node_rank`` being this one, meeting at node 0's
    ``dist_init_addr`` (``HOST:PORT``)."""

    tensor_parallel_size: int
    init_address: str
    # MoE layers split whole experts over the ranks (each rank E / size) instead of slicing each.
    enable_expert_parallel: bool = False
    # Pipeline stages, each of tensor_parallel_size ranks (pipeline x tensor ranks in all).
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks of the whole engine, over every node."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int | None = None) -> range:
        """The global ranks that run on ``node`` (default: this one); node 0 holds rank 0."""
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def local_rank(self, rank: int) -> int:
        """``rank``'s index among its node's ranks (its GPU there)."""
        return rank % self.ranks_per_node


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config`` JSON): the proposer (``method``), drafts
    per step, the draft model's directory (draft_model), the n-gram lengths tried (ngram) and
    the batch size above which nobody speculates."""

    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None

    @staticmethod
    def parse(raw: str | dict | None) -> "SpeculativeConfig | None":
        if raw is None or raw == "":
            return None
        data = json.loads(raw) if isinstance(raw, str) else dict(raw)
        method = data.pop("method", None)
        if method is None and data.get("model"):
            method = "draft_model"  # as vLLM reads a config that names a draft model only
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {method!r}")
        k = int(data.pop("num_speculative_tokens", 0))
        if k < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be at least 1")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, **data)
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config.model (a draft model directory) is required for draft_model")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving (``--enable-lora``): ``max_loras`` adapter slots (distinct adapters in one
    step), the largest rank, and how many loaded adapters the host cache keeps."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int

    @staticmethod
    def from_args(args: "EngineArgs", speculative: "SpeculativeConfig | None") -> "LoRAConfig | None":
        if not args.enable_lora:
            return None
        _check_positive(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
        cpu = args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras
        if cpu < args.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be at least max_loras ({args.max_loras})")
        if speculative is not None and speculative.method == "draft_model":
            raise ValueError("LoRA does not support the draft_model speculative method (the draft model would "
                             "propose without the adapter); use the ngram method or no speculation")
        return LoRAConfig(args.max_loras, args.max_lora_rank, cpu)


@dataclass(frozen=True)
class EngineConfig:
    """The resolved configuration every engine component is built from."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None
    device: str
    seed: int
    enforce_eager: bool
    max_logprobs: int = 20
    structured_outputs_backend: str = "auto"
    lora: LoRAConfig | None = None
    # Embedding models: how a prompt's hidden states are pooled (None: the model generates).
    pooler: PoolerConfig | None = None
    enable_sleep_mode: bool = False
    # Where request images may come from and how many a prompt may hold (the front end's rules).
    media: MediaConfig = field(default_factory=MediaConfig)

    @staticmethod
    def from_args(args: EngineArgs) -> "EngineConfig":
        """Resolve ``args`` into the per-concern configs, group by group (model, then the engine's,
        cache's, scheduler's and parallel flags, then the features that must agree with them). A
        refused option raises ValueError before any weight loads; a draft model's hub name is
        resolved (downloaded) last, once every option is known to go with the others."""
        args = _resolve_hub_names(args)
        device = resolve_device(args.device)
        on_gpu = device.startswith("cuda")
        model_path = _model_path(args)
        model = _model_config(args, model_path, device)
        batched = _max_num_batched_tokens(args, model, on_gpu)
        _check_engine_flags(args)
        _check_cache_flags(args)
        _check_scheduler_flags(args, batched)
        _check_positive(tensor_parallel_size=args.tensor_parallel_size)
        kv_dtype = _resolve_kv_cache_dtype(args.kv_cache_dtype, model.dtype)
        speculative = SpeculativeConfig.parse(args.speculative_config)
        lora = LoRAConfig.from_args(args, speculative)
        pooler = resolve_pooler(model_path, args.task, args.runner, args.pooling_type, args.normalize)
        model = dataclasses.replace(model, embedding_only=pooler is not None)
        _check_single_process_models(args, model, pooler, speculative)
        prefix_caching = _check_hybrid(args, model, speculative, lora)
        pipeline = _check_pipeline_parallel(args, model, speculative, lora)
        sleep_mode = _check_sleep_mode(args, speculative, lora)
        speculative = _resolve_draft_model(args, speculative)
        config = EngineConfig(
            model=model, cache=_cache_config(args, kv_dtype, prefix_caching),
            scheduler=_scheduler_config(args, model, batched, lora, on_gpu),
            parallel=_parallel_config(args, model, pipeline), speculative=speculative,
            device=device, seed=_engine_seed(args.seed), enforce_eager=args.enforce_eager,
            max_logprobs=model.vocab_size if args.max_logprobs == -1 else args.max_logprobs,
            structured_outputs_backend=args.structured_outputs_backend, lora=lora, pooler=pooler,
            enable_sleep_mode=sleep_mode,
            media=MediaConfig.from_flags(args.allowed_media_domains, args.allowed_local_media_path,
                                         args.limit_mm_per_prompt, args.media_fetch_timeout),
        )
        if config.parallel.tensor_parallel_size > 1:  # sizes the model cannot be split into: refused
            check_split_sizes(config)                   # here, before any process starts
        return config


def resolve_model_args(args: EngineArgs) -> EngineArgs:
    """``args`` with hub names replaced by their local files and no model replaced by the built-in
    one's path: what an engine process must load, resolved without torch (``from_args`` resolves
    the result to the same config)."""
    args = _resolve_hub_names(args)
    return args.replace(model=_model_path(args))  # a missing model is refused here


def _model_path(args: EngineArgs) -> str:
    """The model directory or GGUF file to load (the trained built-in model when none is named)."""
    model_path = args.model
    if model_path is None:
        from pagoda.tools.make_model import default_model_path

        model_path = str(default_model_path())
    if Path(model_path).is_file() and not model_path.endswith(".gguf"):
        raise FileNotFoundError(f"model {model_path!r} is a file: give its directory (with config.json), "
                                "or a .gguf file")
    if not Path(model_path).is_dir() and not (Path(model_path).is_file() and model_path.endswith(".gguf")):
        raise FileNotFoundError(f"model directory {model_path!r} does not exist")
    return model_path


def _model_config(args: EngineArgs, model_path: str, device: str) -> ModelConfig:
    """The model's config with its load format, its quantization method and options checked."""
    model = ModelConfig.from_pretrained(model_path, args.tokenizer, args.dtype, args.max_model_len, device,
                                        args.quantization, args.quantization_config)
    if args.load_format == "safetensors":  # vLLM's name for what "auto" loads here
        args = args.replace(load_format="auto")
    if args.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {args.load_format!r}")
    model = dataclasses.replace(model, load_format=args.load_format, generation_defaults=generation_defaults(
        model_path if not model_path.endswith(".gguf") else str(Path(model_path).parent), args.generation_config,
        args.override_generation_config))
    if model.quantization is not None:
        from pagoda.layers.quantization import get_quantization_config

        get_quantization_config(model)  # an unknown method or option fails here, before any load
    return model


def _max_num_batched_tokens(args: EngineArgs, model: ModelConfig, on_gpu: bool) -> int:
    """A step's token budget: the flag, else the device's default; without chunked prefill
    (and no flag) at least ``max_model_len``, so that any legal prompt fits in one step."""
    batched = args.max_num_batched_tokens or (GPU_MAX_NUM_BATCHED_TOKENS if on_gpu else CPU_MAX_NUM_BATCHED_TOKENS)
    if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:
        batched = max(batched, model.max_model_len)
    return batched


def _check_engine_flags(args: EngineArgs) -> None:
    """The engine-wide flags: logprobs cap and structured-output backend."""
    if args.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be non-negative (or -1: the vocabulary), got {args.max_logprobs}")
    if args.structured_outputs_backend not in ("auto", "guidance", "xgrammar"):
        raise ValueError("structured_outputs_backend must be auto, guidance or xgrammar, got "
                         f"{args.structured_outputs_backend!r}")


def _check_cache_flags(args: EngineArgs) -> None:
    """The KV and encoder caches' flags: block size, eviction policy, GPU memory share, bytes."""
    _check_positive(block_size=args.block_size)
    if args.block_size & (args.block_size - 1) or args.block_size > 256:
        raise ValueError(f"block_size must be a power of two up to 256, got {args.block_size}")
    if args.eviction_policy not in ("lru", "lfu"):
        raise ValueError(f"eviction_policy must be lru or lfu, got {args.eviction_policy!r}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if type(args.mm_encoder_cache_bytes) is not int or args.mm_encoder_cache_bytes < 0:
        raise ValueError("mm_encoder_cache_bytes must be a non-negative integer, got "
                         f"{args.mm_encoder_cache_bytes!r}")


def _check_scheduler_flags(args: EngineArgs, batched: int) -> None:
    """The scheduler's flags: step budget, queue policy and time, output cap, steps per round,
    encoder budget."""
    _check_positive(max_num_batched_tokens=batched)
    if args.scheduling_policy not in ("fcfs", "lpm", "priority"):
        raise ValueError(f"scheduling_policy must be fcfs, lpm or priority, got {args.scheduling_policy!r}")
    if args.max_queue_time is not None and not args.max_queue_time > 0:
        raise ValueError(f"max_queue_time must be a positive number of seconds, got {args.max_queue_time!r}")
    if not (isinstance(args.background_holdoff, (int, float)) and 0 <= args.background_holdoff <= 10):
        raise ValueError(f"background_holdoff must be a number of seconds in [0, 10], "
                         f"got {args.background_holdoff!r}")
    cap = args.max_request_output_tokens
    if cap is not None and (type(cap) is not int or cap < 1):
        raise ValueError(f"max_request_output_tokens must be a positive integer, got {cap!r}")
    steps = args.num_scheduler_steps
    if steps is not None and (type(steps) is not int or steps < 1):
        raise ValueError(f"num_scheduler_steps must be an integer of at least 1, got {steps!r}")
    if args.async_scheduling and steps not in (None, 1):
        raise ValueError("async_scheduling runs one decode step per round: leave num_scheduler_steps unset "
                         f"(or 1), got {steps!r}")
    encoder_tokens = args.max_num_encoder_tokens_per_step
    if encoder_tokens is not None and (type(encoder_tokens) is not int or encoder_tokens < 1):
        raise ValueError("max_num_encoder_tokens_per_step must be a positive integer, got "
                         f"{encoder_tokens!r}")


def _check_single_process_models(args: EngineArgs, model: ModelConfig, pooler: PoolerConfig | None,
                                 speculative: SpeculativeConfig | None) -> None:
    """Embedding and vision-language models run on one rank (and embeddings without speculation)."""
    if pooler is not None and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or speculative):
        raise ValueError("embedding models run with tensor_parallel_size and pipeline_parallel_size 1 and "
                         "no speculative_config")
    if model.is_multimodal and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1):
        raise ValueError(f"{model.architecture} (a vision-language model) runs with tensor_parallel_size and "
                         "pipeline_parallel_size 1")


def _resolve_draft_model(args: EngineArgs, speculative: SpeculativeConfig | None) -> SpeculativeConfig | None:
    """``speculative`` with a draft model's hub name replaced by its local files. Called only once
    the options are known to go together, so a refused combination fails with no network call."""
    if speculative is None or not speculative.model:
        return speculative
    from pagoda.models.hub import resolve_model

    return dataclasses.replace(speculative, model=resolve_model(speculative.model, None, args.download_dir,
                                                                args.hf_token))


def _cache_config(args: EngineArgs, kv_dtype: torch.dtype, prefix_caching: bool) -> CacheConfig:
    return CacheConfig(args.block_size, args.kv_cache_memory, args.gpu_memory_utilization, kv_dtype,
                       prefix_caching, args.eviction_policy, KVOffloadConfig.from_args(args),
                       args.mm_encoder_cache_bytes)


def _scheduler_config(args: EngineArgs, model: ModelConfig, batched: int, lora: LoRAConfig | None,
                      on_gpu: bool) -> SchedulerConfig:
    """The scheduler's limits; async scheduling means one decode step per round."""
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs or (GPU_MAX_NUM_SEQS if on_gpu else CPU_MAX_NUM_SEQS),
        max_num_batched_tokens=batched, max_model_len=model.max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold, policy=args.scheduling_policy,
        max_loras=lora.max_loras if lora else 0,
        num_scheduler_steps=1 if args.async_scheduling else args.num_scheduler_steps,
        async_scheduling=bool(args.async_scheduling), max_request_output_tokens=args.max_request_output_tokens,
        max_queue_time=args.max_queue_time,
        max_num_encoder_tokens_per_step=args.max_num_encoder_tokens_per_step or batched,
        fair_step_share=not on_gpu, background_holdoff=args.background_holdoff)


def _parallel_config(args: EngineArgs, model: ModelConfig, pipeline: int) -> ParallelConfig:
    return ParallelConfig(args.tensor_parallel_size, args.distributed_init_address,
                          _check_expert_parallel(args, model), pipeline, **check_nodes(args))


def _resolve_hub_names(args: EngineArgs) -> EngineArgs:
    """``args`` with a hub name of the model or tokenizer replaced by its local files
    (``pagoda/models/hub.py``, which downloads them if needed); local paths stay as they are."""
    if args.model is None and args.tokenizer is None:
        return args
    from pagoda.models.hub import resolve_model, resolve_tokenizer

    model = args.model and resolve_model(args.model, args.revision, args.download_dir, args.hf_token)
    tokenizer = args.tokenizer and resolve_tokenizer(args.tokenizer, args.tokenizer_revision, args.download_dir,
                                                     args.hf_token)
    return args.replace(model=model, tokenizer=tokenizer)


def _check_hybrid(args: EngineArgs, model: ModelConfig, speculative: SpeculativeConfig | None,
                  lora: LoRAConfig | None) -> bool:
    """Refuse what a hybrid model (recurrent layers beside attention) does not support; the
    prefix-caching setting to run with: off for hybrids, whose cached blocks would lack the
    recurrent state at their end (``--enable-prefix-caching`` is then accepted and ignored)."""
    if not model.is_hybrid:
        return args.enable_prefix_caching
    refused = [what for what, used in (
        ("speculative decoding (speculative_config)", speculative is not None),
        ("tensor parallelism", args.tensor_parallel_size > 1),
        ("pipeline parallelism", args.pipeline_parallel_size > 1),
        ("LoRA (enable_lora)", lora is not None),
        ("the KV offload tiers (kv_offload_*)", KVOffloadConfig.from_args(args) is not None)) if used]
    if refused:
        raise ValueError(f"{model.architecture} is a hybrid model (Mamba layers beside attention); pagoda does not "
                         f"support {', '.join(refused)} for hybrid models yet")
    if args.enable_prefix_caching:
        logger.info("prefix caching is off for %s: its Mamba layers' recurrent state is not cached with "
                    "the KV blocks, so no prompt prefix can be reused", model.architecture)
    return False


def _check_sleep_mode(args: EngineArgs, speculative: SpeculativeConfig | None, lora: LoRAConfig | None) -> bool:
    """Sleep mode rebuilds one process's model and cache; what else holds weights or caches
    (tensor / pipeline ranks, a draft model, loaded adapters) is not rebuilt yet."""
    if not args.enable_sleep_mode:
        return False
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or speculative is not None or lora is not None:
        raise ValueError("enable_sleep_mode supports one process without LoRA or speculative decoding: "
                         "tensor_parallel_size and pipeline_parallel_size 1, no speculative_config, no enable_lora")
    if args.kv_offload_cpu_bytes or args.kv_offload_disk_path or args.kv_offload_redis_url:
        raise ValueError("enable_sleep_mode does not combine with the KV tiers (kv_offload_*) yet")
    return True


def _check_expert_parallel(args: EngineArgs, model: ModelConfig) -> bool:
    if not args.enable_expert_parallel:
        return False
    hf = model.hf_config
    experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not experts:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {model.architecture} has no experts")
    if experts % args.tensor_parallel_size:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {args.tensor_parallel_size} does not divide "
                         f"the model's {experts} experts")
    return True


def _check_pipeline_parallel(args: EngineArgs, model: ModelConfig, speculative: SpeculativeConfig | None,
                             lora: LoRAConfig | None) -> int:
    """The pipeline size, refused where a stage would have no layer or a feature cannot follow."""
    p = args.pipeline_parallel_size
    if type(p) is not int or p < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer of at least 1, got {p!r}")
    if p > model.num_layers:
        raise ValueError(f"pipeline_parallel_size {p} is more stages than the model's {model.num_layers} "
                         f"decoder layers (each stage needs at least one)")
    if p > 1 and lora is not None:
        raise ValueError(f"LoRA (enable_lora) does not support pipeline_parallel_size {p} yet")
    if p > 1 and speculative is not None and speculative.method == "draft_model":
        raise ValueError(f"speculative method draft_model does not support pipeline_parallel_size {p} yet "
                         f"(the draft model would be split too); use ngram or pipeline_parallel_size 1")
    return p


def check_nodes(args: EngineArgs) -> dict[str, Any]:
    """``nnodes`` / ``node_rank`` / ``dist_init_addr``, checked: the ranks must divide evenly
    over the nodes, and the nodes need an address to meet at."""
    nnodes, node_rank, addr = args.nnodes, args.node_rank, args.dist_init_addr
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if nnodes < 1:
        raise ValueError(f"nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0 .. nnodes - 1 = {nnodes - 1}, got {node_rank}")
    if world % nnodes:
        raise ValueError(f"the engine's {world} ranks (tensor_parallel_size x pipeline_parallel_size) do not "
                         f"divide evenly over nnodes {nnodes}")
    if nnodes > 1 and not addr:
        raise ValueError("nnodes > 1 needs dist_init_addr HOST:PORT (node 0's address, where the nodes meet)")
    if addr:
        split_host_port(addr)
    return {"nnodes": nnodes, "node_rank": node_rank, "dist_init_addr": addr or None}


def split_host_port(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port), or a ValueError naming the problem."""
    host, sep, port = addr.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT with a port in 1..65535, got {addr!r}")
    return host, int(port)


def check_split_sizes(config: "EngineConfig") -> None:
    """Reject a tensor-parallel size the model's heads and widths cannot be split into (what
    ``EngineConfig.from_args`` checks, in the process that reads the flags)."""
    n, m = config.parallel.tensor_parallel_size, config.model
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
    if m.num_heads % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {m.num_heads} attention heads")
    if m.num_kv_heads % n and n % m.num_kv_heads:
        raise ValueError(f"the model's {m.num_kv_heads} key/value heads are neither divisible by "
                         f"tensor_parallel_size {n} nor a divisor of it")
    if m.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's intermediate size "
                         f"{m.intermediate_size}")
    hf = m.hf_config  # mixture-of-experts sizes split across ranks (experts' own unless expert parallel)
    for key in ("shared_expert_intermediate_size",) + (() if config.parallel.enable_expert_parallel
                                                       else ("moe_intermediate_size",)):
        if hf.get(key) and hf[key] % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide the model's {key} {hf[key]}")


def _engine_seed(seed: object) -> int:
    """The engine's seed: an integer, or None for one drawn at random (vLLM's ``seed=None``;
    drawn once, where the config is built: the ranks get the config, not the arguments)."""
    if seed is None:
        import secrets

        return secrets.randbits(32)
    if type(seed) is not int:
        raise ValueError(f"seed must be an integer (or None), got {seed!r}")
    return seed


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return device


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "False")
