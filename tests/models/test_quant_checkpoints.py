"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) against an oracle that shares
no code with pagoda's loader: each checkpoint is written in its format's published layout by
``quant_checkpoints.py``, dequantized by that module's own reader, and the dense float32 weights
run in Hugging Face ``transformers``. The layouts themselves are checked against the formats'
reference libraries (compressed-tensors, transformers' fp8 loader) and against constants of
published GPTQ / AWQ checkpoints.

Tolerances. pagoda runs fp8 and the dequantizing fallback in float32 (the oracle's arithmetic),
so those match like float models do (``EXACT_LOGPROB_TOL``). The CPU int4/int8 kernels round
activations and scales to bfloat16 (``pagoda/layers/quantization/kernels.py``), which moves
log-probs of this 2-layer test model by up to ~0.13 (mean ~0.02): measured by rounding the
oracle's linear-layer inputs to bfloat16. A single layout mistake, such as a zero point off by
one, moves them by up to ~21 (mean ~4). So those paths are held to ``KERNEL_LOGPROB_TOL``, and,
tighter, every quantized layer's effective weight is compared element by element with the
oracle's (``_check_layer_weights``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quant_checkpoints import (AWQ_ORDER, MODEL_SHAPE, QuantSpec, _pack_cols, dequantize_checkpoint, oracle_model,
                               write_quantized)

from pagoda import LLM, SamplingParams

S = QuantSpec
SPECS = [
    S("gptq", 4, 128),
    S("gptq", 4, 32, sym=False),
    S("gptq", 4, 64, sym=False, desc_act=True),
    S("gptq", 4, -1, desc_act=True),
    S("gptq", 4, 64, sym=False, checkpoint_format="gptq_v2"),
    S("gptq", 8, 64, sym=False, checkpoint_format="gptq_v2"),
    S("gptq", 8, 128, config_in="quantize_config.json"),  # AutoGPTQ's file, no quantization_config
    S("gptq", 8, -1, sym=False, desc_act=True),
    S("awq", 4, 128),
    S("awq", 4, 32),
    S("awq", 4, -1),
    S("ct-int", 4, 128),
    S("ct-int", 4, 32, sym=False),
    S("ct-int", 4, 64, desc_act=True),
    S("ct-int", 4, strategy="channel", sym=False),
    S("ct-int", 8, strategy="channel"),
    S("ct-int", 8, 64, sym=False),
    S("ct-fp8", 8, strategy="tensor"),
    S("ct-fp8", 8, strategy="channel", activations="dynamic"),
    S("ct-fp8", 8, strategy="block", activations="dynamic"),
    S("fp8-block", 8, activations="dynamic"),
    S("fp8-block", 8, block=(32, 64)),
    S("fp8-tensor", 8),
    # Some projections left dense, each format naming them its own way, and mixed schemes.
    S("gptq", 4, 64, dense=("down_proj",)),  # modules_in_block_to_quantize
    S("awq", 4, 64, dense=("o_proj",)),  # modules_to_not_convert
    S("ct-int", 8, strategy="channel", mlp=S("ct-int", 4, 32, sym=False), dense=("down_proj",)),  # groups, ignore
    S("fp8-block", 8, dense=("o_proj",)),  # ignored_layers
]
PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), list(range(100, 190, 3))]
EXACT_LOGPROB_TOL = 2e-4  # as tests/models/test_hf_parity.py: float32 summation order only
KERNEL_LOGPROB_TOL = (0.5, 0.1)  # (max, mean) |log-prob difference| through the bf16 CPU kernels
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    from pagoda.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("qdense"), **MODEL_SHAPE)


@pytest.fixture(scope="module")
def checkpoint(dense_dir, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(spec: QuantSpec) -> Path:
        if spec.name not in made:
            made[spec.name] = tmp_path_factory.mktemp("q") / spec.name
            write_quantized(dense_dir, made[spec.name], spec)
        return made[spec.name]

    return get


def _parts(name: str) -> list[str]:
    head, _, leaf = name.rpartition(".")
    return [f"{head}.{p}" for p in FUSED.get(leaf, (leaf,))]


def _layer_weight(module, in_features: int) -> torch.Tensor:
    """What the layer multiplies by: its output on the identity matrix (exact in bfloat16 too)."""
    with torch.no_grad():
        return module.quant_method.apply(module, torch.eye(in_features), None).t().float()


def _check_weight(name: str, got: torch.Tensor, want: torch.Tensor, step: torch.Tensor | None) -> None:
    """Element by element: fp8 and the fallback dequantize exactly; the bf16 kernels may move a
    weight by at most 2^-8 of itself (scale and output rounding) plus 1/32 of its step (the
    rounded zero term), and any error in codes, zero points, groups or order moves some weight
    by a whole step or more."""
    if step is None:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=name)
        return
    bound = 2**-7 * want.abs() + step / 8
    worst = ((got - want).abs() / bound).max().item()
    assert worst <= 1, f"{name}: a weight is off by {worst:.2f}x the kernel's rounding bound"


def _check_layer_weights(model, weights: dict, steps: dict, spec: QuantSpec, num_layers: int) -> set[str]:
    """Compare every quantized layer with the oracle's weights; returns the kernels used.
    Exactly the projections the checkpoint quantizes are quantized."""
    kernels, quantized = set(), 0
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        parts = _parts(name)
        want = torch.cat([weights[p + ".weight"] for p in parts])
        if any(p.rpartition(".")[2] in spec.dense for p in parts):
            assert not hasattr(module, "qlinear") and torch.equal(_layer_weight(module, want.shape[1]), want), name
            continue
        step = torch.cat([steps[p + ".weight"] for p in parts]) if parts[0] + ".weight" in steps else None
        _check_weight(name, _layer_weight(module, want.shape[1]), want, step)
        kernels.add(module.qlinear.kernel)
        quantized += 1
    assert quantized == (4 - len(spec.dense)) * num_layers
    return kernels


def _logprob_diffs(llm_outs, hf) -> torch.Tensor:
    diffs = []
    for prompt, out in zip(PROMPTS, llm_outs):
        sample = out.outputs[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + sample.token_ids])).logits[0].float().log_softmax(-1)
        rows = list(enumerate(out.prompt_logprobs[1:])) + [(len(prompt) - 1 + j, e)
                                                           for j, e in enumerate(sample.logprobs)]
        diffs += [abs(v - ref[i, t].item()) for i, entry in rows for t, v in entry.items()]
    return torch.tensor(diffs)


def _matches_oracle(qdir: Path, spec: QuantSpec, num_layers: int = MODEL_SHAPE["num_layers"]) -> None:
    steps: dict[str, torch.Tensor] = {}
    weights = dequantize_checkpoint(qdir, steps)
    llm = LLM(str(qdir), dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        kernels = _check_layer_weights(llm.engine.core.executor.model, weights, steps, spec, num_layers)
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5, logprobs=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    if spec.bits == 4 and spec.mlp is None:  # int4 always maps onto a packed int4 kernel, act order included
        assert kernels in ({"int4pack"}, {"woq"})  # woq: pagoda's AVX512-BF16 kernel, where the CPU has it
    diffs = _logprob_diffs(outs, oracle_model(qdir, weights))
    if kernels & {"int4pack", "int8pack", "woq"}:
        assert diffs.max() <= KERNEL_LOGPROB_TOL[0] and diffs.mean() <= KERNEL_LOGPROB_TOL[1], \
            (diffs.max().item(), diffs.mean().item())
    else:
        assert diffs.max() <= EXACT_LOGPROB_TOL, diffs.max().item()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_match_transformers_on_the_dequantized_weights(spec, checkpoint):
    _matches_oracle(checkpoint(spec), spec)


@pytest.mark.parametrize("arch,spec", [("qwen2", S("awq", 4, 32)), ("qwen2", S("gptq", 8, 32, sym=False)),
                                       ("qwen3", S("gptq", 4, 32, sym=False, desc_act=True)),
                                       ("qwen3", S("ct-fp8", 8, strategy="channel"))],
                         ids=["qwen2-awq", "qwen2-gptq8", "qwen3-gptq-actorder", "qwen3-fp8"])
def test_other_architectures(arch, spec, model_factory, tmp_path):
    """Qwen2 (q/k/v biases, stored dense beside the packed weights) and Qwen3 (q/k norms, an
    explicit head_dim, tied embeddings)."""
    write_quantized(model_factory(arch), tmp_path / spec.name, spec)
    _matches_oracle(tmp_path / spec.name, spec, num_layers=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_models_run_on_the_int_kernels(dtype, checkpoint):
    """GPTQ and AWQ checkpoints ship float16; the CPU int4 kernel computes in bfloat16 and must
    take either activation dtype (greedy output as in float32 for this model's clear margins)."""
    qdir = checkpoint(S("gptq", 4, 128))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for dt in ("float32", dtype):
        llm = LLM(str(qdir), dtype=dt, kv_cache_memory=8 << 20, max_model_len=128)
        try:
            outs[dt] = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.shutdown()
    assert outs[dtype] == outs["float32"]


# ------------------------------------------------------------------------------ layouts


# (transformers decompresses every dense layer with one config group, so mixed schemes are left out)
LIBRARY_SPECS = [s for s in SPECS if s.fmt in ("ct-int", "ct-fp8", "fp8-block") and not s.desc_act and s.mlp is None]


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("spec", LIBRARY_SPECS, ids=lambda s: s.name)
def test_written_layout_is_what_the_reference_library_reads(spec, checkpoint):
    """compressed-tensors' own decompressor (through transformers) and transformers' fp8 block
    dequantizer read the test's checkpoints to the test reader's weights (rounded, like them,
    to the scales' dtype)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    qdir = checkpoint(spec)
    if spec.fmt == "fp8-block":
        quant = FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(spec.block))
    else:
        quant = CompressedTensorsConfig(run_compressed=False)
    state = AutoModelForCausalLM.from_pretrained(str(qdir), dtype=torch.float32,
                                                 quantization_config=quant).state_dict()
    ours = dequantize_checkpoint(qdir)
    if spec.dense:  # an ignored module loads as the plain weight it is
        assert all(torch.equal(state[n].float(), w) for n, w in ours.items() if n.rsplit(".", 2)[-2] in spec.dense)
    compared = 0
    for name, weight in ours.items():
        if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            theirs = state[name].float()
            bf16_scales = spec.fmt == "ct-int" or (spec.fmt == "ct-fp8" and spec.strategy == "channel")
            bf16_scales = bf16_scales and name.rsplit(".", 2)[-2] not in spec.dense
            assert torch.equal(theirs, weight.bfloat16().float() if bf16_scales else weight), name
            compared += 1
    assert compared == 7 * MODEL_SHAPE["num_layers"]


def test_compressed_tensors_act_order_codes_unpack_like_the_library(checkpoint):
    """``actorder: group`` left compressed-tensors' current loaders, so for that variant only the
    packing is compared: the library's unpacking of ``weight_packed`` and the reader's codes."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    spec = S("ct-int", 4, 64, desc_act=True)
    tensors = load_file(str(checkpoint(spec) / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    shape = torch.Size(tensors[f"{name}.weight_shape"].tolist())
    codes = unpack_from_int32(tensors[f"{name}.weight_packed"], 4, shape).float()
    g = tensors[f"{name}.weight_g_idx"].long()
    weight = dequantize_checkpoint(checkpoint(spec))[f"{name}.weight"]
    assert torch.equal(codes * tensors[f"{name}.weight_scale"].float()[:, g], weight)
    assert not torch.equal(g, torch.arange(g.numel()) // 64)  # really act-ordered


def test_gptq_and_awq_packing_constants(checkpoint):
    """Facts of published checkpoints: a symmetric GPTQ v1 checkpoint stores zero point 8 (4
    bits) / 128 (8 bits) minus one in every field, i.e. words 0x77777777 / 0x7F7F7F7F; AutoAWQ
    packs columns 0..7 into nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7."""
    from safetensors.torch import load_file

    for bits, word in ((4, 0x77777777), (8, 0x7F7F7F7F)):
        tensors = load_file(str(checkpoint(S("gptq", bits, 128)) / "model.safetensors"))
        zeros = tensors["model.layers.1.self_attn.o_proj.qzeros"]
        assert bool((zeros == word).all())
    assert _pack_cols(torch.arange(8)[None], 4, AWQ_ORDER).item() == 0x75316420


def test_gptq_v1_zero_point_of_zero_survives_the_offset():
    """GPTQModel writes v1 zero points by subtracting 0x11111111 from each packed word, so a zero
    point of 0 borrows from its neighbour; pagoda undoes it word-wise and gets every field back."""
    from pagoda.layers.quantization.gptq import zero_points

    zeros = torch.tensor([[0, 15, 0, 7, 1, 0, 15, 8], [3, 0, 0, 0, 0, 0, 0, 0]])
    packed = _pack_cols(zeros, 4).to(torch.int64) - 0x11111111
    v1 = torch.where(packed < -2**31, packed + 2**32, packed).to(torch.int32)
    assert torch.equal(zero_points(v1, 4, v1=True), zeros.to(torch.int32))
    assert torch.equal(zero_points(_pack_cols(zeros, 4), 4, v1=False), zeros.to(torch.int32))


# ----------------------------------------------------------------------------- refusals


def _ct_group(patch: dict, weights: dict | None = None, **top) -> object:
    def apply(cfg: dict) -> None:
        group = cfg["config_groups"]["group_0"]
        group.update(patch)
        group["weights"].update(weights or {})
        cfg.update(top)
    return apply


_W8A8 = {"input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                               "strategy": "token"}, "format": "int-quantized"}
_FP8_STATIC = {"input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                     "strategy": "tensor"}}
REFUSALS = {
    "gptq-3bit": (S("gptq", 4, 128), {"bits": 3}, r"GPTQ checkpoints with bits=3 are not supported"),
    "gptq-2bit": (S("gptq", 4, 128), {"bits": 2}, r"bits=2 are not supported"),
    "gptq-marlin": (S("gptq", 4, 128), {"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not"),
    "gptq-is-marlin-format": (S("gptq", 4, 128), {"is_marlin_format": True}, r"checkpoint_format 'marlin'"),
    "gptq-quantized-lm-head": (S("gptq", 4, 128), {"lm_head": True}, r"quantized lm_head"),
    "gptq-dynamic-overrides": (S("gptq", 4, 128), {"dynamic": {"-:.*down_proj": {}}}, r"'dynamic'"),
    "awq-gemv": (S("awq", 4, 128), {"version": "gemv"}, r"AWQ version 'gemv' is not supported"),
    "awq-gemv-fast": (S("awq", 4, 128), {"version": "gemv_fast"}, r"'gemv_fast'"),
    "awq-no-zero-point": (S("awq", 4, 128), {"zero_point": False}, r"without zero points"),
    "awq-8bit": (S("awq", 4, 128), {"bits": 8}, r"AWQ checkpoints with bits=8"),
    "ct-w8a8-int8-activations": (S("ct-int", 8, strategy="channel"), _ct_group(_W8A8), r"int8 activation quantization \(W8A8\)"),
    "ct-3bit": (S("ct-int", 4, 128), _ct_group({}, {"num_bits": 3}), r"3-bit integer weights"),
    "ct-fp8-static-activations": (S("ct-fp8", 8, strategy="tensor"), _ct_group(_FP8_STATIC), r"static"),
    "ct-nvfp4": (S("ct-fp8", 8, strategy="tensor"), _ct_group({"format": "nvfp4-pack-quantized"}, {"num_bits": 4}),
                 r"4-bit float weights"),
    "ct-sparse": (S("ct-int", 4, 128), _ct_group({}, sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity"),
    "ct-kv-cache-scheme": (S("ct-int", 4, 128), _ct_group({}, kv_cache_scheme={"num_bits": 8, "type": "float"}),
                           r"kv_cache_scheme"),
    "ct-not-compressed": (S("ct-int", 4, 128), {"quantization_status": "frozen"}, r"quantization_status 'frozen'"),
    "fp8-static-activations": (S("fp8-tensor", 8), {"activation_scheme": "static"}, r"activation_scheme 'static'"),
    "fp8-e5m2": (S("fp8-block", 8), {"fmt": "e5m2"}, r"fmt 'e5m2'"),
    "bitsandbytes": (S("awq", 4, 128), {"quant_method": "bitsandbytes"}, r"bitsandbytes \(NF4/int8\) checkpoints are not"),
    "unknown-method": (S("awq", 4, 128), {"quant_method": "mystery"}, r"quant_method 'mystery' are not supported"),
}


def _patched(checkpoint, spec: QuantSpec, patch, out: Path) -> Path:
    """The checkpoint's files but its weights (refused before any weight is read), config patched."""
    shutil.copytree(checkpoint(spec), out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if callable(patch):
        patch(config["quantization_config"])
    else:
        config["quantization_config"].update(patch)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case", REFUSALS.values(), ids=REFUSALS.keys())
def test_unsupported_variants_are_refused_by_name(case, checkpoint, tmp_path):
    spec, patch, message = case
    with pytest.raises(ValueError, match=message):
        LLM(str(_patched(checkpoint, spec, patch, tmp_path / "q")), dtype="float32", kv_cache_memory=8 << 20)


@pytest.mark.parametrize("spec", [S("gptq", 4, 64, dense=("k_proj",)), S("awq", 4, 64, dense=("up_proj",)),
                                  S("ct-int", 4, 64, dense=("v_proj",)), S("fp8-block", 8, dense=("k_proj",))],
                         ids=lambda s: s.fmt)
def test_a_fused_layer_quantized_only_in_part_is_refused(spec, checkpoint):
    """q/k/v (gate/up) run as one matmul in pagoda: a checkpoint that leaves one of them dense is
    refused, naming the fused layer, instead of loading it wrongly."""
    with pytest.raises(ValueError, match=r"model\.layers\.0\.(self_attn\.qkv_proj|mlp\.gate_up_proj).* quantized alike"):
        LLM(str(checkpoint(spec)), dtype="float32", kv_cache_memory=8 << 20)


def test_quantized_mixture_of_experts_is_refused(checkpoint, tmp_path):
    out = shutil.copytree(checkpoint(S("gptq", 4, 128)), tmp_path / "moe")
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                  num_experts_per_tok=2)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pre-quantized mixture-of-experts checkpoints \(MixtralForCausalLM, gptq\)"):
        LLM(str(out), dtype="float32", kv_cache_memory=8 << 20)


def test_quantization_flag_must_match_the_checkpoint(checkpoint):
    qdir = checkpoint(S("gptq", 4, 128))
    for other in ("awq", "int8", "fp8"):
        with pytest.raises(ValueError, match=rf"quantized with 'gptq'; --quantization '{other}' cannot be applied"):
            LLM(str(qdir), quantization=other, kv_cache_memory=8 << 20)
    llm = LLM(str(qdir), quantization="gptq", dtype="float32", kv_cache_memory=8 << 20, max_model_len=128)
    try:
        assert "GPTQConfig(bits=4, group_size=128" in repr(llm.engine.core.executor.model.quant_config)
    finally:
        llm.shutdown()


# -------------------------------------------------------------------- tensor parallelism


def _load_as_rank(path: Path, rank: int, size: int, monkeypatch):
    from pagoda.config import ModelConfig
    from pagoda.distributed import parallel_state
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.models.loader import load_model

    cfg = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "_TP", parallel_state.TPGroup(rank, size))
        return load_model(cfg, TorchAttentionBackend(), "cpu")


def _assembled(modules: list, name: str) -> torch.Tensor:
    """The full weight from each rank's effective weight: column-parallel ranks hold output
    rows (per fused projection), row-parallel ranks input columns."""
    parts = [_layer_weight(m, m.in_features) for m in modules]
    leaf = name.rpartition(".")[2]
    if leaf in ("o_proj", "down_proj"):
        return torch.cat(parts, dim=1)
    sizes = ([modules[0].q_size, modules[0].kv_size, modules[0].kv_size] if leaf == "qkv_proj"
             else [p.shape[0] // 2 for p in parts[:1]] * 2)
    pieces = [p.split(sizes) for p in parts]
    return torch.cat([torch.cat([rank[i] for rank in pieces]) for i in range(len(sizes))])


TP_SPECS = [S("gptq", 4, 64, sym=False, desc_act=True), S("gptq", 8, 32, sym=False), S("awq", 4, 64),
            S("ct-int", 4, 32, sym=False), S("ct-int", 8, strategy="channel"), S("ct-fp8", 8, strategy="tensor"),
            S("fp8-block", 8, block=(32, 64))]


@pytest.mark.parametrize("spec", TP_SPECS, ids=lambda s: s.name)
def test_tensor_parallel_shards_assemble_to_the_checkpoint(spec, checkpoint, monkeypatch):
    """Every rank of 2 loads only its slice (qweight/qzeros/scales/g_idx split consistently), and
    the slices put together are the checkpoint's weights."""
    qdir = checkpoint(spec)
    steps: dict[str, torch.Tensor] = {}
    weights = dequantize_checkpoint(qdir, steps)
    ranks = [dict(_load_as_rank(qdir, r, 2, monkeypatch).named_modules()) for r in range(2)]
    checked = 0
    for name, module in ranks[0].items():
        if hasattr(module, "qlinear"):
            parts = _parts(name)
            want = torch.cat([weights[p + ".weight"] for p in parts])
            step = torch.cat([steps[p + ".weight"] for p in parts]) if steps else None
            _check_weight(name, _assembled([r[name] for r in ranks], name), want, step)
            checked += 1
    assert checked == 4 * MODEL_SHAPE["num_layers"]


@pytest.mark.parametrize("spec,message", [
    (S("gptq", 4, 128), r"group_size 128 does not divide its 64 input features per rank .* splits a quantization group"),
    (S("awq", 4, 128), r"AWQ: group_size 128 does not divide"),
    (S("ct-int", 4, 128), r"compressed-tensors: group_size 128 does not divide"),
    (S("fp8-block", 8), r"splits its blocks of 128"),
], ids=["gptq", "awq", "compressed-tensors", "fp8-block"])
def test_a_tensor_parallel_size_that_splits_a_group_is_refused(spec, message, checkpoint, monkeypatch):
    with pytest.raises(ValueError, match=message):
        _load_as_rank(checkpoint(spec), 0, 2, monkeypatch)


# ------------------------------------------------------------------------------ DeepSeek-V3


def test_deepseek_v3_fp8_checkpoint_matches_transformers(model_factory, tmp_path):
    """DeepSeek-V3 ships every matrix but embeddings, LM head and routers in fp8 with
    ``weight_scale_inv`` blocks. pagoda keeps its decoder MLPs (the dense layers, the shared
    experts) in fp8 and dequantizes the rest (MLA projections, routed experts) at load; blocks of
    16x16 here, so that the test model's odd sizes (40, 24) end in partial blocks."""
    from safetensors.torch import load_file

    spec = S("fp8-block", 8, block=(16, 16), every_linear=True)
    qdir = tmp_path / spec.name
    write_quantized(model_factory("deepseek_v3"), qdir, spec)
    stored = load_file(str(qdir / "model.safetensors"))
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert any("experts.0.down_proj" in n for n in fp8) and any("kv_b_proj" in n for n in fp8)
    assert all(n[:-len("weight")] + "weight_scale_inv" in stored for n in fp8)
    weights = dequantize_checkpoint(qdir)
    llm = LLM(str(qdir), dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        model = llm.engine.core.executor.model
        kept = [n for n, m in model.named_modules() if hasattr(m, "qlinear")]
        assert kept and all(n.endswith(("gate_up_proj", "down_proj")) for n in kept)
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5, logprobs=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    diffs = _logprob_diffs(outs, oracle_model(qdir, weights, through=tmp_path / "oracle"))
    assert diffs.max() <= EXACT_LOGPROB_TOL, diffs.max().item()
