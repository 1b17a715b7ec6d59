"""GGUF files: the shared tiny checkpoints written as GGUF in every tensor type pagoda reads,
served by pagoda and checked against ``transformers`` loading the same file (``gguf_file=``,
which dequantizes everything): greedy tokens equal and logprobs within a per-type tolerance.
Also the metadata-built config, the block decoding against ``gguf.quants.dequantize``, the
kernel each layer lands on, Llama 3's rope_freqs, and the refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_helpers import K_LAYOUTS, export, per_layer, random_k_blocks
from pagoda import LLM, SamplingParams
from tests.models.parity_helpers import hf_greedy, hf_logprobs

gguf = pytest.importorskip("gguf")

PROMPTS = [[5, 77, 300, 12, 9, 401, 33], list(range(20, 60)), [7] * 3]
# hidden 256 / intermediate 512: every matrix holds whole K-quant super-blocks of 256.
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
# What a Q4_K_M file holds: Q4_K with Q6_K for attn_v, ffn_down and the output.
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
# Every other type once; gate/up are Q4_1 + Q4_0, which share the int4 kernel.
OTHERS = {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q5_K", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
          "ffn_up": "Q4_0", "ffn_down": "Q5_1"}

# name -> (checkpoint spec, model_factory overrides, ftype, per-tensor types, logprob tolerance).
# Float and dequantized types compute what transformers computes (float32): 1e-4. The int4
# kernel (Q4_x, and Q8_0 as two 4-bit planes) rounds activations to 16-bit fixed point: 3e-3.
# The Q4_K_M file's q/k/v (Q4_K fused with a Q6_K v) is requantized to int8 per output channel:
# REQUANT_ATOL, greedy checked where the margin is clear.
FILES = {
    "llama-f32": ("llama", {}, "f32", {}, 1e-4),
    "llama-f16": ("llama", {}, "f16", {}, 1e-4),
    "llama-bf16": ("llama", {}, "bf16", {}, 1e-4),
    "llama-q8_0": ("llama", {}, "q8_0", {}, 3e-3),
    "llama-q4_0": ("llama", {}, "q4_0", {}, 3e-3),
    "qwen2-q4_0": ("qwen2", {}, "q4_0", {}, 3e-3),
    "qwen3-q8_0": ("qwen3", {"head_dim": 128}, "q8_0", {}, 3e-3),  # transformers assumes head_dim 128
    "llama-q4_k_m": ("llama", K_SHAPE, "f32", {**per_layer(Q4_K_M, 2), "token_embd.weight": "Q4_K",
                                               "output.weight": "Q6_K"}, None),
    "qwen2-others": ("qwen2", K_SHAPE, "f32", {**per_layer(OTHERS, 2), "token_embd.weight": "Q5_K",
                                               "output.weight": "BF16"}, 3e-3),
}


@pytest.fixture(scope="module")
def gguf_file(model_factory, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            spec, overrides, ftype, types, _ = FILES[name]
            made[name] = export(model_factory(spec, **overrides), tmp_path_factory.mktemp(name) / f"{name}.gguf",
                                ftype, types)
        return made[name]

    return get


def hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _engine(path: Path | str, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory=16 << 20, max_model_len=512, dtype="float32", **kw)


# int8-channel moves each weight by at most max|w_row| / 254 (about 0.7% of the weights' norm on
# these files); on this small model, whose logits are large, the top-2 logprobs then move by up
# to 0.35 nats (measured), and transformers' own top-2 gap is below 0.1 at some steps, so greedy
# tokens are compared where that gap is clear and the rest teacher-forced.
REQUANT_ATOL = 0.5


@pytest.mark.parametrize("name", [n for n, f in FILES.items() if f[4] is not None])
def test_gguf_matches_transformers_on_the_same_file(gguf_file, name: str) -> None:
    from pagoda.kernels import woq

    path, atol = gguf_file(name), FILES[name][4]
    hf = hf_from_gguf(path)
    llm = _engine(path)
    try:
        if FILES[name][2] == "q8_0" and woq.supported(woq.KIND_INT8G):  # Q8_0 on the grouped int8 kind
            model = llm.engine.core.executor.model
            kinds = {m.qlinear.kind for m in model.modules() if hasattr(m, "qlinear")}
            assert kinds == {woq.KIND_INT8G}, kinds
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            tokens = out.outputs[0].token_ids
            assert tokens == hf_greedy(hf, prompt, 12)
            ref = hf_logprobs(hf, prompt + tokens)
            for j, entry in enumerate(out.outputs[0].logprobs):
                for token, value in entry.items():
                    assert value == pytest.approx(ref[len(prompt) - 1 + j, token].item(), abs=atol), (name, j)
    finally:
        llm.shutdown()


# The Q4_K_M file as it loads by default (Q6_K on int8 in groups of 16, the q/k/v fused with a Q6_K
# v requantized to int8 per channel) and with its Q6_K tensors kept dense (``{"q6_k":
# "dequantize"}``): then only Q4_K's scales and offsets, rounded to float16, move its logprobs
# (by up to 0.02 measured on this model).
Q4_K_M_RUNS = [({}, REQUANT_ATOL), ({"quantization_config": {"q6_k": "dequantize"}}, 0.03)]


@pytest.mark.parametrize("options,atol", Q4_K_M_RUNS, ids=["q6_k-int8", "q6_k-dequantize"])
def test_q4_k_m_file_within_the_requantization_tolerance(gguf_file, options: dict, atol: float) -> None:
    """The Q4_K_M file (Q4_K on int4, its scales and offsets rounded to float16, Q6_K and the Q6_K
    head on int8 in groups of 16, the q/k/v fused with a Q6_K v requantized to int8 per channel;
    or Q6_K kept dense)
    teacher-forced on transformers' greedy continuation: the continuation's logprobs (its tokens
    and the top 2) within ``atol``, and pagoda's top token is transformers' wherever transformers'
    top-2 gap is at least twice that. (Tail logprobs, e.g. a random prompt token's -18, move by
    up to ~3% of themselves with the requantization.)"""
    path = gguf_file("llama-q4_k_m")
    hf = hf_from_gguf(path)
    llm = _engine(path, **options)
    clear = 0
    try:
        conts = {i: hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p + conts[i]} for i, p in enumerate(PROMPTS)], params,
                            use_tqdm=False)
        for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
            ids = prompt + conts[i]
            ref = hf_logprobs(hf, ids)
            for pos in range(len(prompt), len(ids)):  # the continuation: its tokens and top 2
                entry = out.prompt_logprobs[pos]
                for token, value in entry.items():
                    assert value == pytest.approx(ref[pos - 1, token].item(), abs=atol), (i, pos)
                top2 = torch.topk(ref[pos - 1], 2).values
                if float(top2[0] - top2[1]) >= 2 * atol:
                    assert max(entry, key=entry.get) == ids[pos], (i, pos)
                    clear += 1
    finally:
        llm.shutdown()
    assert clear >= 10  # most continuation steps are clear ones


def test_config_from_metadata_equals_the_checkpoints(model_factory, gguf_file) -> None:
    from pagoda.config import ModelConfig

    for name in ("llama-q4_0", "qwen2-q4_0", "qwen3-q8_0"):
        spec, overrides, *_ = FILES[name]
        ours = ModelConfig.from_pretrained(str(gguf_file(name)), None, "float32", None, "cpu")
        ref = ModelConfig.from_pretrained(str(model_factory(spec, **overrides)), None, "float32", None, "cpu")
        for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                      "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm",
                      "bos_token_id"):
            assert getattr(ours, field) == getattr(ref, field), (name, field)
        assert set(ref.eos_token_ids) <= set(ours.eos_token_ids)
        assert ours.quantization == "gguf" and ours.path.endswith(".gguf")


def test_explicit_head_dim_qwen3_matches_its_checkpoint(model_factory, tmp_path) -> None:
    """Qwen3 with head_dim != hidden / heads (as Qwen3's published models have), tied
    embeddings and q/k norms: transformers' GGUF reader drops the head size, so the oracle is
    the float32 checkpoint the F32 file was written from."""
    from tests.models.parity_helpers import check_greedy, check_logprobs, hf_model

    ckpt = model_factory("qwen3")
    path = export(ckpt, tmp_path / "qwen3.gguf", "f32")
    llm = _engine(path)
    try:
        hf = hf_model(ckpt)
        check_logprobs(llm, hf, PROMPTS, max_tokens=6, atol=1e-4)
        check_greedy(llm, hf, PROMPTS[:2], n=12)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixture_of_experts_gguf_matches_its_checkpoint(arch, model_factory, tmp_path) -> None:
    """Mixtral (written by llama.cpp as ``llama`` with experts), Qwen2-MoE (shared expert and its
    gate) and Qwen3-MoE: stacked expert tensors split per expert, router and counts from the
    metadata. transformers' GGUF reader cannot build these tiny shapes, so the oracle is the
    float32 checkpoint the F32 file was written from. Every layer sparse, as GGUF has them."""
    from tests.conftest import MODEL_SPECS
    from tests.models.parity_helpers import check_greedy, check_logprobs, hf_model

    extra = dict(MODEL_SPECS[arch]["extra_config"])
    if arch != "mixtral":
        extra.update(mlp_only_layers=[], decoder_sparse_step=1)
    ckpt = model_factory(arch, extra_config=extra)
    path = export(ckpt, tmp_path / f"{arch}.gguf", "f32")
    llm = _engine(path)
    try:
        expect = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
        assert llm.engine.core.executor.model.config.architecture == expect
        hf = hf_model(ckpt)
        check_logprobs(llm, hf, PROMPTS[:2], max_tokens=4, atol=1e-4)
        check_greedy(llm, hf, PROMPTS[:2], n=10)
    finally:
        llm.shutdown()


def _linears(llm: LLM) -> dict[str, object]:
    layer = llm.engine.core.executor.model.model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}


def test_each_layer_lands_on_its_kernel(gguf_file) -> None:
    """Q4_0/Q4_1/Q4_K layers keep their codes on the int4 kernel (group 32), Q8_0 the int8 one
    (on a CPU with the weight-only kernel: its int8-in-groups kind, group 32, the head too);
    Q6_K int8 in groups of 16 (the head too), a fused layer mixing it with Q4_K int8 per channel;
    the other types are dense.
    The LM head follows its own type (a Q6_K, Q4_0 or Q8_0 head is quantized, F16/BF16 dense)."""
    from pagoda.kernels import woq
    from pagoda.layers.quantization.base import UnquantizedLinearMethod
    from pagoda.layers.quantization.gguf_quant import GGUFLinearMethod

    grouped = woq.supported(woq.KIND_INT8G)

    expect = {"llama-q4_0": {"qkv": "int4", "o": "int4", "gate_up": "int4", "down": "int4", "head": True},
              "llama-q8_0": {"qkv": "int8", "o": "int8", "gate_up": "int8", "down": "int8", "head": True},
              "llama-q4_k_m": {"qkv": "int8-channel", "o": "int4", "gate_up": "int4", "down": "int8-g16",
                               "head": True},
              "qwen2-others": {"qkv": None, "o": None, "gate_up": "int4", "down": None, "head": False},
              "llama-f16": {"qkv": None, "o": None, "gate_up": None, "down": None, "head": False}}
    for name, kinds in expect.items():
        llm = _engine(gguf_file(name))
        try:
            for part, linear in _linears(llm).items():
                method = linear.quant_method
                if kinds[part] is None:
                    assert type(method) is UnquantizedLinearMethod, (name, part)
                else:
                    assert isinstance(method, GGUFLinearMethod) and method.kind == kinds[part], (name, part)
                    assert linear.qlinear.nbytes < linear.in_features * linear.out_features * 2, (name, part)
                    group = {"int8": 32, "int8-g16": 16}.get(kinds[part])
                    if group and grouped:  # Q8_0 / Q6_K: 1 byte + a float16 scale per 32 / 16
                        assert (linear.qlinear.kind, linear.qlinear.group_size) == (woq.KIND_INT8G, group), part
                        assert linear.qlinear.nbytes == linear.in_features * linear.out_features * (1 + 2 / group)
            head = llm.engine.core.executor.model.lm_head
            assert hasattr(head, "qlinear") == kinds["head"], name
            if name in ("llama-q8_0", "llama-q4_k_m") and grouped:
                assert (head.qlinear.kind, head.qlinear.group_size) == (woq.KIND_INT8G, 32 if "q8" in name else 16)
            if name in HEAD_BOUNDS:
                _check_head(head, gguf_file(name), HEAD_BOUNDS[name])
        finally:
            llm.shutdown()


# The LM head's effective weight against gguf's decoding of output.weight, as a share of its row's
# largest weight: Q4_0 on int4 exactly (float32 rounding); Q6_K on int8 in groups of 16, its group
# scales rounded to float16 on a CPU (each weight within 2**-11 of itself; a per-channel
# requantization's half step is max|w_row| / 254).
HEAD_BOUNDS = {"llama-q4_0": 0.0, "llama-q4_k_m": 2.0 ** -11}


def _check_head(head, path: Path, per_row_max: float) -> None:
    from pagoda.bench.gguf_export import read_gguf

    ref = torch.from_numpy(read_gguf(path)["output.weight"])
    with torch.no_grad():
        got = head.qlinear(torch.eye(ref.shape[1]), None).t()[: ref.shape[0]]
    assert head.qlinear.nbytes < ref.numel() * 2
    bound = ref.abs().amax(1, keepdim=True) * per_row_max * (1 + 1e-5) + 1e-6 * ref.abs().max()
    err = (got - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def _load_as_rank(path: Path, rank: int, size: int, monkeypatch) -> dict[str, object]:
    from pagoda.config import ModelConfig
    from pagoda.distributed import parallel_state
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.models.loader import load_model

    cfg = ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu")
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "_TP", parallel_state.TPGroup(rank, size))
        return dict(load_model(cfg, TorchAttentionBackend(), "cpu").named_modules())


def _effective_weight(module, width: int | None = None) -> torch.Tensor:
    """What a linear layer (or, given its ``width``, the LM head) multiplies by: its output on the
    identity (exact on the int4 and int8 kernels: each identity row is one value, 16-bit fixed
    point holds it exactly)."""
    with torch.no_grad():
        return module.qlinear(torch.eye(width or module.in_features), None).t()


@pytest.mark.parametrize("name", ["llama-q4_0", "llama-q8_0", "llama-q4_k_m"])
def test_tensor_parallel_ranks_hold_slices_of_the_one_rank_weights(gguf_file, name, monkeypatch) -> None:
    """Two ranks load only their slices of the codes, scales and zero points (q/k/v by head,
    gate/up by row, o/down by input group; int8-channel's per-row scales with their rows, whole
    on a row-parallel rank; the LM head by vocabulary rows, read from the file), and the slices
    put together are one rank's weights."""
    one = _load_as_rank(gguf_file(name), 0, 1, monkeypatch)
    ranks = [_load_as_rank(gguf_file(name), r, 2, monkeypatch) for r in range(2)]
    checked = 0
    hidden = one["model.embed_tokens"].weight.shape[1]
    for key, module in one.items():
        if not hasattr(module, "qlinear"):
            continue
        leaf = key.rpartition(".")[2]
        width = hidden if leaf == "lm_head" else None
        parts = [_effective_weight(r[key], width) for r in ranks]
        if leaf == "lm_head":
            got = torch.cat(parts)
        elif leaf in ("o_proj", "down_proj"):
            got = torch.cat(parts, dim=1)
        else:
            m0 = ranks[0][key]
            sizes = [m0.q_size, m0.kv_size, m0.kv_size] if leaf == "qkv_proj" else [parts[0].shape[0] // 2] * 2
            pieces = [p.split(sizes) for p in parts]
            got = torch.cat([torch.cat([rank[i] for rank in pieces]) for i in range(len(sizes))])
        torch.testing.assert_close(got, _effective_weight(module, width), rtol=1e-6, atol=1e-7, msg=key)
        checked += 1
    assert checked == 4 * 2 + 1


# ------------------------------------------------------------------------- block decoding


def _random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid blocks of a gguf-quantizable type: random codes, fp16 scale fields in a sane range,
    some blocks with a zero scale (their values are their offset alone)."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    heads = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}[qtype]
    for at in heads:
        values = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    raw[0, 0, 0:2] = 0  # a zero scale
    if qtype == "Q4_K":
        raw[1, 0, 4:16] = 0  # sub-block scales and mins of zero
        raw[2, 0, 4:8] = 0  # scales zero, mins not: sub-blocks of one value
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_kernel_blocks_decode_to_what_gguf_dequantizes(qtype: str) -> None:
    from gguf import quants

    from pagoda.layers.quantization.gguf_quant import decode_kernel_tensor

    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols, seed=len(qtype))
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(rows, cols)
    q, scales, zeros = decode_kernel_tensor(raw, qtype, rows, cols)
    assert q.shape == (rows, cols) and scales.shape == (rows, cols // 32)
    w = q.to(torch.float32).view(rows, cols // 32, 32)
    if zeros is not None:
        assert int(q.max()) <= 15 and int(q.min()) >= 0
        w = w - zeros[:, :, None]
    w = (w * scales[:, :, None]).view(rows, cols).numpy()
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("qtype", sorted(K_LAYOUTS))
def test_random_k_blocks_have_the_asked_spread(qtype: str) -> None:
    """The test encoder itself: valid blocks whose decoded values have the source's spread."""
    from gguf import quants

    arr = np.random.default_rng(1).normal(0, 0.03, size=(8, 512)).astype(np.float32)
    out = quants.dequantize(random_k_blocks(arr, qtype), gguf.GGMLQuantizationType[qtype])
    assert np.isfinite(out).all()
    assert out.std() == pytest.approx(0.03, rel=0.05)
    assert abs(out.mean()) < 0.3 * out.std()


def test_realistic_k_encoders_decode_near_their_source() -> None:
    """The tests' Q4_K / Q6_K writers: gguf decodes their blocks to the source within one step
    of each format (Q4_K: a 32-value range / 15 plus the 6-bit min's rounding; Q6_K: a
    16-value max / 31 plus the 8-bit sub-block scale's rounding)."""
    from gguf import quants

    from gguf_helpers import q4_k_blocks, q6_k_blocks

    w = np.random.default_rng(4).normal(0, 0.05, size=(8, 512)).astype(np.float32)
    for qtype, blocks, group, step in (("Q4_K", q4_k_blocks(w), 32, 1 / 15), ("Q6_K", q6_k_blocks(w), 16, 1 / 31)):
        back = quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).reshape(w.shape)
        spread = np.abs(w).reshape(8, -1, group).max(-1, keepdims=True) * 2
        assert (np.abs(back - w).reshape(8, -1, group) <= spread * step).all(), qtype
        assert np.linalg.norm(back - w) / np.linalg.norm(w) < (0.1 if qtype == "Q4_K" else 0.03), qtype


@pytest.mark.parametrize("cols", [256, 96, 1376])
def test_q8_0_on_the_grouped_int8_kernel_is_exact(cols) -> None:
    """Q8_0 on a CPU: the int8 codes and float16 block scales on the weight-only kernel's
    int8-in-groups kind (where the variant has it) compute the dequantized weight's product up to
    the kernel's activation rounding (16-bit fixed point per row: at most max|x| * 2**-16 per
    element), with K of three groups to 43."""
    from gguf import quants

    from pagoda.kernels import woq
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantization.gguf_quant import GGUFConfig, decode_kernel_tensor

    rows = 32
    w = np.random.default_rng(2).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    raw = quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    ref_w = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(rows, cols))
    layer = ReplicatedLinear(cols, rows, False, torch.float32, GGUFConfig({"lin": "Q8_0"}), "lin")
    q, s, _ = decode_kernel_tensor(raw, "Q8_0", rows, cols)
    layer.qweight.data.copy_(q)
    layer.scales.data.copy_(s)
    layer.process_weights_after_loading()
    if woq.supported(woq.KIND_INT8G):
        assert (layer.qlinear.kernel, layer.qlinear.kind, layer.qlinear.group_size) == ("woq", woq.KIND_INT8G, 32)
    else:
        assert layer.qlinear.kernel == "dequant"
    x = torch.randn(5, cols)
    err = (layer(x) - x @ ref_w.T).abs()
    bound = x.abs().amax(1, keepdim=True) * 2.0 ** -16 * ref_w.abs().sum(1)[None, :] * 2 + 1e-6
    assert bool((err <= bound).all()), float((err / bound).max())
    per_channel = ref_w.abs().amax(1)[None, :] / 254 * x.abs().sum(1, keepdim=True)
    assert float(err.max()) < 0.01 * float(per_channel.min())  # far below a per-channel requantization


def test_q6_k_decodes_to_ggufs_values_on_int8_groups_of_16() -> None:
    """A Q6_K tensor's codes and group scales (``d * sc``, 16 a super-block) multiply to exactly
    gguf's decoding; the layer runs on int8 in groups of 16 (the grouped kind on a CPU that has
    it) within the float16 rounding of the scales (2**-11 of each weight) plus the kernel's
    activation rounding (16-bit fixed point per row)."""
    from gguf_helpers import q6_k_blocks

    from pagoda.kernels import woq
    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantization.gguf_quant import GGUFConfig, decode_kernel_tensor, dequantize_rows

    rows, cols = 32, 512
    w = np.random.default_rng(3).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    raw = q6_k_blocks(w)
    ref = torch.from_numpy(dequantize_rows(raw, "Q6_K", rows, cols))
    q, scales, zeros = decode_kernel_tensor(raw, "Q6_K", rows, cols, 16)
    assert zeros is None and q.dtype == torch.int8 and scales.shape == (rows, cols // 16)
    assert int(q.min()) >= -32 and int(q.max()) <= 31
    assert torch.equal(q.float() * scales.repeat_interleave(16, 1), ref)
    layer = ReplicatedLinear(cols, rows, False, torch.float32, GGUFConfig({"lin": "Q6_K"}), "lin")
    assert layer.quant_method.kind == "int8-g16"
    layer.qweight.data.copy_(q)
    layer.scales.data.copy_(scales)
    layer.process_weights_after_loading()
    if woq.supported(woq.KIND_INT8G):
        assert (layer.qlinear.kind, layer.qlinear.group_size) == (woq.KIND_INT8G, 16)
    with torch.no_grad():
        got = layer(torch.eye(cols)).t()
    assert bool(((got - ref).abs() <= ref.abs() * 2.0 ** -11 + 1e-9).all())
    x = torch.randn(5, cols)
    err = (layer(x) - x @ ref.T).abs()
    bound = (x.abs() @ ref.abs().T) * 2.0 ** -11 + x.abs().amax(1, keepdim=True) * 2.0 ** -15 * ref.abs().sum(1)
    assert bool((err <= bound * 1.001 + 1e-6).all())


def test_a_layer_fusing_q8_0_and_q6_k_is_int8_in_groups_of_16() -> None:
    """Q8_0 q/k with a Q6_K v stay exact on int8 in groups of 16 (each Q8_0 scale serves both
    halves of its block); Q4_K with Q6_K is requantized per channel; ``{"q6_k": "int8-channel"}``
    requantizes a Q6_K layer per channel."""
    from gguf import quants

    from pagoda.layers.quantization.gguf_quant import GGUFConfig, decode_kernel_tensor

    prefix = "model.layers.0.self_attn"
    config = GGUFConfig({f"{prefix}.q_proj": "Q8_0", f"{prefix}.k_proj": "Q8_0", f"{prefix}.v_proj": "Q6_K"})
    assert config.layer_kind(f"{prefix}.qkv_proj") == "int8-g16"
    assert config.kept_kind(f"{prefix}.q_proj") == "int8-g16"
    mixed = GGUFConfig({f"{prefix}.q_proj": "Q4_K", f"{prefix}.k_proj": "Q4_K", f"{prefix}.v_proj": "Q6_K"})
    assert mixed.layer_kind(f"{prefix}.qkv_proj") == "int8-channel"
    assert GGUFConfig({"lin": "Q6_K"}, q6_k="int8-channel").layer_kind("lin") == "int8-channel"
    w = np.random.default_rng(5).normal(0, 0.05, size=(4, 64)).astype(np.float32)
    raw = quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    q, scales, _ = decode_kernel_tensor(raw, "Q8_0", 4, 64, 16)
    assert scales.shape == (4, 4) and torch.equal(scales[:, 0::2], scales[:, 1::2])
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(4, 64)
    assert torch.equal(q.float() * scales.repeat_interleave(16, 1), torch.from_numpy(ref))


def test_q6_k_requantized_per_channel_within_half_a_step() -> None:
    """``{"q6_k": "int8-channel"}``: a Q6_K layer on the int8 per-channel kernel, its effective
    weight gguf's decoding of the blocks within half an int8 step (``max|w_row| / 254``), and a
    product with it within that bound plus the kernel's activation rounding (16-bit fixed point
    per row)."""
    from gguf_helpers import q6_k_blocks

    from pagoda.layers.linear import ReplicatedLinear
    from pagoda.layers.quantization.gguf_quant import GGUFConfig, dequantize_rows, requantize_int8

    rows, cols = 32, 512
    w = np.random.default_rng(3).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    ref = torch.from_numpy(dequantize_rows(q6_k_blocks(w), "Q6_K", rows, cols))
    layer = ReplicatedLinear(cols, rows, False, torch.float32, GGUFConfig({"lin": "Q6_K"}, q6_k="int8-channel"),
                             "lin")
    assert layer.quant_method.kind == "int8-channel"
    q, scales = requantize_int8(ref.numpy())
    layer.qweight.data.copy_(q)
    layer.scales.data.copy_(scales)
    layer.process_weights_after_loading()
    step = ref.abs().amax(1, keepdim=True) / 254
    with torch.no_grad():
        got = layer(torch.eye(cols)).t()
    assert bool(((got - ref).abs() <= step * (1 + 1e-5)).all())
    x = torch.randn(5, cols)
    err = (layer(x) - x @ ref.T).abs()
    bound = x.abs().sum(1, keepdim=True) * step.T + x.abs().amax(1, keepdim=True) * 2.0 ** -15 * ref.abs().sum(1)
    assert bool((err <= bound * 1.001).all())


# ---------------------------------------------------------------------------- rope, errors


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def test_llama3_rope_freqs_become_llama3_scaling(model_factory, tmp_path) -> None:
    """llama.cpp bakes Llama 3.1's rope scaling into per-frequency divisors (``rope_freqs``);
    the loader recovers the parameters, and the model matches the checkpoint it was written
    from (transformers' GGUF reader drops rope_freqs, so the checkpoint is the oracle)."""
    from tests.models.parity_helpers import check_greedy, check_logprobs, hf_model

    from pagoda.bench.gguf_export import llama3_rope_factors
    from pagoda.config import ModelConfig
    from pagoda.models.gguf_loader import llama3_scaling

    factors = llama3_rope_factors(LLAMA3_ROPE, 500000.0, 128)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    assert llama3_scaling(factors, 500000.0, 128) == LLAMA3_ROPE
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling(np.linspace(1, 3, 64).astype(np.float32), 500000.0, 128)

    ckpt = model_factory("llama", rope_scaling=LLAMA3_ROPE)
    path = export(ckpt, tmp_path / "llama3.gguf", "f32")
    assert ModelConfig.from_pretrained(str(path), None, "float32", None, "cpu").rope_scaling == LLAMA3_ROPE
    llm = _engine(path)
    try:
        hf = hf_model(ckpt)
        check_logprobs(llm, hf, PROMPTS[:2], max_tokens=4, atol=1e-4)
        check_greedy(llm, hf, PROMPTS[1:2], n=12)
    finally:
        llm.shutdown()


def _write_raw(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_files_are_refused_by_name(gguf_file, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma2'.*llama, qwen2, qwen3"):
        _engine(_write_raw(tmp_path / "g.gguf", "gemma2", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)}))
    tq = gguf.GGMLQuantizationType.TQ2_0
    bad = tmp_path / "tq" / "m.gguf"
    bad.parent.mkdir()
    _write_raw(bad, "llama", {"token_embd.weight": (np.zeros((4, 256), np.float32), None),
                              "blk.0.attn_q.weight": (gguf.quants.quantize(np.zeros((4, 256), np.float32), tq), tq)})
    with pytest.raises(ValueError, match=r"tensor types pagoda does not read: TQ2_0; supported: F32"):
        _engine(bad)
    moe = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(moe), "llama")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"lacks the metadata key llama.embedding_length"):
        _engine(moe)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(60)))
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        _engine(corrupt)
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.gguf", "b.gguf"):
        (two / n).symlink_to(gguf_file("llama-q4_0"))
    with pytest.raises(ValueError, match="several GGUF files"):
        _engine(two)
    split = tmp_path / "m-00001-of-00002.gguf"
    split.symlink_to(gguf_file("llama-q4_0"))
    with pytest.raises(ValueError, match="split GGUF"):
        _engine(split)
    with pytest.raises(ValueError, match="quantized with 'gguf'"):
        _engine(gguf_file("llama-q4_0"), quantization="int8")


def test_a_directory_holding_one_gguf_and_an_hf_tokenizer(gguf_file, model_factory, tmp_path) -> None:
    """``LLM(dir)`` finds the one .gguf; ``tokenizer=`` may name a Hugging Face tokenizer
    directory instead of the file's own; both tokenize alike here and generate alike."""
    one = tmp_path / "one"
    one.mkdir()
    (one / "model-Q4_0.gguf").symlink_to(gguf_file("llama-q4_0"))
    ckpt = model_factory("llama")
    results = []
    for kw in ({}, {"tokenizer": str(ckpt)}):
        llm = _engine(one, **kw)
        try:
            tok = llm.get_tokenizer()
            assert tok.chat_template
            out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            results.append((tok("The quick brown fox").input_ids, out[0].outputs[0].token_ids))
        finally:
            llm.shutdown()
    assert results[0] == results[1]


def test_q6_k_option_is_checked_and_keeps_q6_k_dense(gguf_file) -> None:
    """``{"q6_k": "dequantize"}`` loads every Q6_K tensor (and a q/k/v fused with one) dense, the
    Q4_K layers still on int4; by default Q6_K is int8 in groups of 16, with ``"int8-channel"``
    requantized per channel; an unknown value or key is refused at start-up."""
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.layers.quantization.gguf_quant import GGUFConfig

    path = gguf_file("llama-q4_k_m")
    config = EngineConfig.from_args(EngineArgs(model=str(path), quantization_config='{"q6_k": "dequantize"}'))
    quant = GGUFConfig.from_config(config.model.quantization_config, True)
    assert quant.layer_kind("model.layers.0.self_attn.qkv_proj") is None
    assert quant.layer_kind("model.layers.0.mlp.down_proj") is None
    assert quant.layer_kind("model.layers.0.mlp.gate_up_proj") == "int4"
    assert quant.head_kind() is None
    default = EngineConfig.from_args(EngineArgs(model=str(path))).model.quantization_config
    assert GGUFConfig.from_config(default, True).layer_kind("model.layers.0.mlp.down_proj") == "int8-g16"
    channel = EngineConfig.from_args(EngineArgs(model=str(path), quantization_config='{"q6_k": "int8-channel"}'))
    assert GGUFConfig.from_config(channel.model.quantization_config, True).head_kind() == "int8-channel"
    with pytest.raises(ValueError, match="q6_k must be one of"):
        EngineConfig.from_args(EngineArgs(model=str(path), quantization_config='{"q6_k": "bf16"}'))
    with pytest.raises(ValueError, match="already quantized"):
        EngineConfig.from_args(EngineArgs(model=str(path), quantization_config='{"group_size": 64}'))
