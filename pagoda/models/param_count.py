"""How many parameters a model holds, and how many one token uses, from its config alone
(torch-free: the engine logs it before loading, benchmarks read it from ``config.json``).

Counts follow the layers pagoda builds for each architecture: grouped-query or multi-head latent
(MLA) attention with their biases and norms, dense MLPs, mixture-of-experts blocks (router,
experts, shared experts and their gate, DeepSeek's score-correction bias). A mixture of experts
holds every expert but a token runs only its top-k of them: ``active`` counts those, which is
what a decode step's roofline reads per token at batch 1."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part. ``layers`` / ``layers_active``: the decoder layers' weights, all of
    them / those one token uses; ``vectors``: the 1-D ones among them (norms, biases, routers'
    bias) plus the final norm, which the roofline counts at their own dtype."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    layers: int
    layers_active: int
    final_norm: int
    vectors: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.layers + self.final_norm

    @property
    def active(self) -> int:
        """Parameters one token's forward uses (MoE: its top-k routed experts only)."""
        return self.embedding + self.lm_head + self.layers_active + self.final_norm


def count_params(model: Any) -> ParamCount:
    """``model``: a ``ModelConfig`` (shape fields, flags and the checkpoint's ``hf_config``)."""
    h = model.hidden_size
    layers = active = vectors = 0
    norms = _LAYER_NORMS.get(model.architecture, 2) * h  # the RMSNorms around attention and MLP
    hybrid = _hybrid(model) if model.architecture in ("GraniteMoeHybridForCausalLM", "BambaForCausalLM") else None
    for index in range(model.num_layers):
        if hybrid is not None:  # a Mamba or attention mixer, then the shared MLP (+ experts)
            attn, attn_vectors = hybrid[0][index]
            mlp, mlp_active, mlp_vectors = hybrid[1]
        else:
            attn, attn_vectors = _attention(model)
            mlp, mlp_active, mlp_vectors = _mlp(model, index)
        layers += attn + mlp + norms
        active += attn + mlp_active + norms
        vectors += attn_vectors + mlp_vectors + norms
    embedding = model.vocab_size * h
    return ParamCount(embedding, 0 if model.tie_word_embeddings else embedding, layers, active, h, vectors + h)


# Norms of hidden size per layer where a family has other than two (``models.decoder.LayerNorms``).
_LAYER_NORMS = {"Gemma2ForCausalLM": 4, "Gemma3ForCausalLM": 4, "Glm4ForCausalLM": 4}


def _attention(model: Any) -> tuple[int, int]:
    """(parameters, of which 1-D) of one attention block."""
    h, hf, heads = model.hidden_size, model.hf_config, model.num_heads
    if hf.get("kv_lora_rank"):  # multi-head latent attention
        bias = bool(hf.get("attention_bias", False))
        kv_rank, rope, nope, v = (hf["kv_lora_rank"], hf["qk_rope_head_dim"], hf["qk_nope_head_dim"],
                                  hf["v_head_dim"])
        q_rank, qk = hf.get("q_lora_rank"), nope + rope
        q = h * q_rank + q_rank + q_rank * heads * qk + (q_rank if bias else 0) if q_rank else h * heads * qk
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v) + ((kv_rank + rope) if bias else 0)
        o = heads * v * h + (h if bias else 0)
        ones = (q_rank or 0) + kv_rank + (((q_rank or 0) + kv_rank + rope + h) if bias else 0)
        return q + kv + o, ones
    q, kv = heads * model.head_dim, model.num_kv_heads * model.head_dim
    ones = (q + 2 * kv if model.qkv_bias else 0) + (h if model.o_bias else 0) + \
        (2 * model.head_dim if model.qk_norm else 0)
    if model.architecture == "Olmo2ForCausalLM":  # q/k norms over the whole projections
        ones += q + kv
    if model.architecture == "GptOssForCausalLM":  # a sink logit per head
        ones += heads
    return h * (q + 2 * kv) + q * h + ones, ones


def _mlp(model: Any, index: int) -> tuple[int, int, int]:
    """(parameters, those one token uses, of which 1-D) of layer ``index``'s MLP."""
    h, hf = model.hidden_size, model.hf_config
    dense = 3 * h * model.intermediate_size
    if hf.get("n_routed_experts"):  # DeepSeek: dense first layers, then experts + shared experts
        if index < (hf.get("first_k_dense_replace") or 0):
            return dense, dense, 0
        experts, k, size = hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
        router = experts * h + experts  # weight + score-correction bias
        shared = 3 * h * size * (hf.get("n_shared_experts") or 0)
        expert = 3 * h * size
        return router + shared + experts * expert, router + shared + k * expert, experts
    if model.architecture == "GptOssForCausalLM":  # biased router and experts in every layer
        experts, k, i = hf["num_local_experts"], hf["num_experts_per_tok"], model.intermediate_size
        biases = 2 * i + h
        expert = 3 * h * i + biases
        router = experts * h + experts
        return router + experts * expert, router + k * expert, experts + experts * biases
    if model.architecture.startswith("Llama4"):  # dense layers of their own size, or experts + a shared one
        if not _llama4_moe(hf, index):
            dense = 3 * h * (hf.get("intermediate_size_mlp") or model.intermediate_size)
            return dense, dense, 0
        experts, k = hf["num_local_experts"], hf.get("num_experts_per_tok", 1)
        fixed = experts * h + dense  # router and the shared expert
        return fixed + experts * dense, fixed + k * dense, 0
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not experts or not _is_sparse(model, index):
        return dense, dense, 0
    k = hf["num_experts_per_tok"]
    expert = 3 * h * (hf.get("moe_intermediate_size") or model.intermediate_size)
    shared_size = hf.get("shared_expert_intermediate_size") or 0
    fixed = experts * h + (3 * h * shared_size + h if shared_size else 0)  # router, shared expert and its gate
    return fixed + experts * expert, fixed + k * expert, 0


def _hybrid(model: Any) -> tuple[list[tuple[int, int]], tuple[int, int, int]]:
    """Granite 4 hybrids and Bamba: each layer's mixer (parameters, of which 1-D), and the MLP
    every layer has (the rules of ``models.granite_hybrid`` and ``models.bamba``)."""
    from pagoda.models.registry import bamba_layer_kinds, layer_kinds

    h, hf = model.hidden_size, model.hf_config
    heads, state, groups = hf["mamba_n_heads"], hf["mamba_d_state"], hf.get("mamba_n_groups", 1)
    inner = int(hf.get("mamba_expand", 2) * h)
    conv_dim = inner + 2 * groups * state
    proj_bias = bool(hf.get("mamba_proj_bias", False))
    conv_bias = conv_dim if hf.get("mamba_conv_bias", True) else 0
    ones = 3 * heads + inner + conv_bias + ((inner + conv_dim + heads + h) if proj_bias else 0)
    mamba = h * (inner + conv_dim + heads) + conv_dim * hf.get("mamba_d_conv", 4) + inner * h + ones
    attention = _attention(model)
    bamba = model.architecture == "BambaForCausalLM"
    kinds = bamba_layer_kinds(hf) if bamba else layer_kinds(hf)
    mixers = [(mamba, ones) if kind == "mamba" else attention for kind in kinds]
    if bamba:  # a dense MLP
        dense = 3 * h * model.intermediate_size
        return mixers, (dense, dense, 0)
    shared = 3 * h * hf["shared_intermediate_size"]
    experts, k = hf.get("num_local_experts") or 0, hf.get("num_experts_per_tok") or 0
    expert = 3 * h * model.intermediate_size
    fixed = shared + experts * h
    return mixers, (fixed + experts * expert, fixed + k * expert, 0)


def _llama4_moe(hf: dict, index: int) -> bool:
    """Llama 4's mixture-of-experts layers (the rule of ``models.llama4.is_moe_layer``)."""
    layers = hf.get("moe_layers")
    if layers is not None:
        return index in layers
    return (index + 1) % int(hf.get("interleave_moe_layer_step", 1)) == 0


def _is_sparse(model: Any, index: int) -> bool:
    """Which layers are mixtures of experts (the rule of ``models.moe.is_sparse_layer``)."""
    hf = model.hf_config
    if model.architecture == "MixtralForCausalLM":
        return True
    step = hf.get("decoder_sparse_step", 1) or 1
    return index not in (hf.get("mlp_only_layers") or []) and (index + 1) % step == 0
