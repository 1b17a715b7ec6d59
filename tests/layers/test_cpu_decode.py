"""The fused CPU decode blocks (``pagoda.models.cpu_decode``): every decode step of at most
``MAX_ROWS`` sequences runs each qualifying decoder layer as two C++ calls. Each test runs the same greedy
batch with the blocks on and off (``PAGODA_CPU_FUSED_DECODE=0``) and checks that the blocks
really ran, that the tokens are the same and that the sampled tokens' logprobs agree to float32
rounding (the blocks use the same kernels as the layer-by-layer path, summed in other orders)."""
from __future__ import annotations

import gc

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.models import cpu_decode
from pagoda.kernels import select, woq
from pagoda.models.decoder import DecoderLayer

pytestmark = pytest.mark.skipif(not select.fused_decode_enabled(), reason="the fused decode blocks are switched off")

# Prompts of different lengths: the decode rows have different context lengths and positions.
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 31, 64], [300, 2, 9, 11], [77] * 23]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


def _run(model_dir, monkeypatch, fused: bool, prompts=PROMPTS, check=None, **kwargs):
    """Greedy tokens and their logprobs, the number of layers that got fused blocks (and how many
    of those fused their MLP too), and how many fused block calls ran. ``check(model)`` is asked
    about the loaded model first."""
    monkeypatch.setenv(cpu_decode.ENV_VAR, "1" if fused else "0")
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=256, **kwargs)
    if check is not None:
        check(llm.engine.core.executor.model)
    layers = [m for m in llm.engine.core.executor.model.modules() if isinstance(m, DecoderLayer)]
    blocks = [layer.cpu_decode for layer in layers if layer.cpu_decode is not None]
    calls: list[str] = []

    class Counting:
        """The kernel library's op namespace, counting its block calls (``decode_layers`` ...)."""

        def __init__(self, module) -> None:
            self.module = module

        def __getattr__(self, op):
            fn = getattr(self.module, op)
            name = op.removeprefix("decode_")

            def counted(*args):
                # ``layers`` runs a whole stage: one attention and one MLP block per layer.
                calls.extend(["attn_block", "mlp_block"] * len(args[0]) + [name] if name == "layers" else [name])
                if name == "layers":
                    stacks.append(len(args[0]))
                return fn(*args)
            return counted

    stacks: list[int] = []
    for block in blocks:
        block.module = Counting(block.module)
    stack = llm.engine.core.executor.model.model.cpu_decode_stack
    if stack is not None:
        stack.module = Counting(stack.module)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    fused_mlp = sum(b.mlp is not None for b in blocks)
    # Where every layer fused both blocks, decode steps run the stage as one ``layers`` call.
    assert (stack is not None) == (bool(blocks) and fused_mlp == len(layers))
    assert stack is None or stack.final_norm  # one stage: the model's final norm runs in the call too
    assert not stacks or set(stacks) == {len(layers)}
    del llm
    gc.collect()
    return tokens, logprobs, len(blocks), fused_mlp, calls


def _compare(model_dir, monkeypatch, expect_layers: int, expect_mlp: int, prompts=PROMPTS, atol: float = 2e-4,
             check=None, **kwargs) -> None:
    tokens, logprobs, layers, mlp, calls = _run(model_dir, monkeypatch, True, prompts, check, **kwargs)
    ref_tokens, ref_logprobs, ref_layers, _, ref_calls = _run(model_dir, monkeypatch, False, prompts, **kwargs)
    assert (layers, mlp) == (expect_layers, expect_mlp)
    assert ref_layers == 0 and not ref_calls
    # A model whose layers all fused both blocks runs its decode steps as one call per step.
    assert ("layers" in calls) == (expect_mlp == expect_layers)
    # Every decode step (11 per prompt after the first token; all prompts decode together).
    assert calls.count("attn_block") >= 11 * expect_layers
    assert calls.count("mlp_block") * expect_layers == calls.count("attn_block") * expect_mlp
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_fused_blocks_match_layer_by_layer(model_factory, monkeypatch, name):
    """GQA (llama), q/k/v biases (qwen2), q/k RMSNorm, explicit head_dim and tied embeddings (qwen3)."""
    _compare(model_factory(name), monkeypatch, expect_layers=2, expect_mlp=2)


def test_sliding_window(model_factory, monkeypatch):
    """A window shorter than the prompts: the fused attention reads only the last keys."""
    _compare(model_factory("mistral", sliding_window=6), monkeypatch, expect_layers=2, expect_mlp=2)


def test_mixture_of_experts_keeps_its_mlp(model_factory, monkeypatch):
    """A MoE layer's attention is fused; its experts run as the module (no mlp_block)."""
    _compare(model_factory("qwen3_moe"), monkeypatch, expect_layers=2, expect_mlp=1)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights(model_factory, monkeypatch, quantization):
    """Weights quantized for the compiled int8/int4 kernel are multiplied through it in the blocks."""
    if not woq.supported(woq.KIND_INT8 if quantization == "int8" else woq.KIND_INT4):
        pytest.skip("the quantized kernel needs AVX2 or AVX-512 (the scalar variant has none)")
    model_dir = model_factory("llama", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    # The quantized kernel rounds each activation row to 16-bit fixed point (a step of 2**-15 of
    # the row's largest value), so a float32 rounding difference in its input can move a product
    # by a step: the logprobs agree to 1e-3 rather than to float32 rounding.
    _compare(model_dir, monkeypatch, expect_layers=2, expect_mlp=2, atol=1e-3, quantization=quantization)


def test_gguf_q8_0_inside_the_blocks(model_factory, monkeypatch, tmp_path):
    """A GGUF Q8_0 matrix is the kernel's int8-in-groups kind: the blocks run it (with q/k/v
    biases), and the decode steps stay one call each."""
    if not woq.supported(woq.KIND_INT8G):
        pytest.skip("the quantized kernel needs AVX2 or AVX-512 (the scalar variant has none)")
    from pagoda.bench.gguf_export import write_gguf

    model_dir = model_factory("qwen2", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    path = write_gguf(model_dir, tmp_path / "m-q8_0.gguf", "q8_0")  # qwen2: q/k/v biases

    def on_the_grouped_kind(model) -> None:
        kinds = {(m.qlinear.kind, m.qlinear.group_size) for m in model.modules() if hasattr(m, "qlinear")}
        assert kinds == {(woq.KIND_INT8G, 32)}

    _compare(path, monkeypatch, expect_layers=2, expect_mlp=2, atol=1e-3, check=on_the_grouped_kind, dtype="float32")


def test_float32_panel_kernel_inside_the_blocks(model_factory, monkeypatch):
    """Every float32 decode product through the panel kernel (``PAGODA_CPU_GEMM=panel``; the blocks
    call it by its address), with seven sequences so that row tiles of one to seven run too."""
    from pagoda.layers import cpu_gemm

    from pagoda.kernels import panel as cpu_panel

    if not cpu_panel.supported():
        pytest.skip("no AVX2 or AVX-512 here")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "panel")
    prompts = PROMPTS + [[i + 10, i + 20, i + 30, 7 * i + 1] for i in range(4)]
    _compare(model_factory("qwen2"), monkeypatch, expect_layers=2, expect_mlp=2, prompts=prompts)


def test_larger_batches_use_onednn_inside_the_blocks(model_factory, monkeypatch):
    """Seven sequences decoding together: past four rows the blocks multiply through oneDNN's
    packed weights (as the layers do), with the same results."""
    from pagoda.layers import cpu_gemm

    monkeypatch.setenv(cpu_gemm.ENV_VAR, "gemv")  # the gemv kernel up to four rows, oneDNN beyond (no tiles)
    prompts = [[i + 10, i + 20, i + 30, 7 * i + 1] for i in range(7)]
    _compare(model_factory("llama"), monkeypatch, expect_layers=2, expect_mlp=2, prompts=prompts)


def test_more_than_max_rows_run_layer_by_layer(model_factory, monkeypatch):
    """A step of more than ``MAX_ROWS`` sequences runs the layer-by-layer path."""
    monkeypatch.setattr(cpu_decode, "MAX_ROWS", 4)
    prompts = [[i + 10, i + 20, i + 30] for i in range(5)]
    tokens, _, layers, _, calls = _run(model_factory("llama"), monkeypatch, True, prompts)
    ref_tokens, _, _, _, _ = _run(model_factory("llama"), monkeypatch, False, prompts)
    assert layers == 2 and calls == []
    assert tokens == ref_tokens


def test_quantized_kv_cache_is_not_fused(model_factory, monkeypatch):
    """An int8 KV cache needs the quantizing cache write: no layer gets the fused blocks."""
    _, _, layers, _, calls = _run(model_factory("llama"), monkeypatch, True, kv_cache_dtype="int8")
    assert layers == 0 and calls == []


@pytest.mark.parametrize("name,gemm", [("llama", "auto"), ("qwen3", "auto"), ("llama", "amx"), ("qwen3", "panel")])
def test_bfloat16_model(model_factory, monkeypatch, name, gemm):
    """A bfloat16 model (bfloat16 weights and KV cache): the blocks compute in float32 and hand
    bfloat16 rows back, so they round less than the op-by-op bfloat16 path. On every position
    where the three runs still agree, the blocks' logprobs are no farther from the float32
    model's than op-by-op bfloat16's are, and within bfloat16 rounding of op-by-op's. ``amx``:
    every decode product through the AMX kernel (linked into the blocks' library); ``panel``:
    through the bfloat16 panel kernel (what CPUs without AMX use), likewise."""
    from pagoda.layers import cpu_gemm

    if gemm == "amx":
        if select.isa().level != "amx":
            pytest.skip("no AMX-BF16 here")
        monkeypatch.setenv(cpu_gemm.ENV_VAR, "amx")
    if gemm == "panel":
        if select.isa().variant != "avx512":
            pytest.skip("no AVX512-BF16 here")
        monkeypatch.setenv(cpu_gemm.ENV_VAR, "panel")
    model_dir = model_factory(name)
    tokens, logprobs, layers, mlp, calls = _run(model_dir, monkeypatch, True, dtype="bfloat16")
    ref_tokens, ref_logprobs, _, _, ref_calls = _run(model_dir, monkeypatch, False, dtype="bfloat16")
    exact_tokens, exact_logprobs, _, _, _ = _run(model_dir, monkeypatch, False, dtype="float32")
    assert (layers, mlp) == (2, 2) and not ref_calls
    assert calls.count("attn_block") >= 11 * layers and calls.count("mlp_block") == calls.count("attn_block")
    fused_err = ref_err = apart = 0.0
    compared = 0
    for p in range(len(PROMPTS)):
        for i, (a, b, c) in enumerate(zip(tokens[p], ref_tokens[p], exact_tokens[p])):
            if not a == b == c:
                break  # past a flip the sequences differ: nothing left to compare
            fused_err = max(fused_err, abs(logprobs[p][i] - exact_logprobs[p][i]))
            ref_err = max(ref_err, abs(ref_logprobs[p][i] - exact_logprobs[p][i]))
            apart = max(apart, abs(logprobs[p][i] - ref_logprobs[p][i]))
            compared += 1
    assert compared >= len(PROMPTS) * len(tokens[0]) // 2, compared
    assert fused_err <= 1.25 * ref_err + 1e-3, (fused_err, ref_err)
    assert apart <= 0.15, apart


def test_block_arguments_are_released_with_the_model(model_factory, monkeypatch):
    """The blocks' arguments (weights and KV cache references among them) live in the compiled
    module under handles until the layers' blocks are collected."""
    monkeypatch.setenv(cpu_decode.ENV_VAR, "1")
    llm = LLM(str(model_factory("llama")), kv_cache_memory=16 << 20, max_model_len=256)
    layers = [m for m in llm.engine.core.executor.model.modules() if isinstance(m, DecoderLayer)]
    handles = [(layer.cpu_decode.attn, layer.cpu_decode.mlp) for layer in layers]
    module = layers[0].cpu_decode.module
    assert len(handles) == 2 and all(a is not None and m is not None for a, m in handles)
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="row"):  # registered: the lookup passes, the rows are refused
        module.decode_mlp_block(handles[0][1], x[:, :0], x, False)
    llm.shutdown()
    del llm, layers
    gc.collect()
    for attn, mlp in handles:
        with pytest.raises(RuntimeError, match="unknown MLP block"):
            module.decode_mlp_block(mlp, x, x, False)
        with pytest.raises(RuntimeError, match="unknown attention block"):
            module.decode_attn_block(attn, x, x, x, x, x, x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_stack_matches_the_per_layer_blocks_bit_for_bit(model_factory, monkeypatch, dtype):
    """The whole stage as one call (``FusedDecodeStack``, with the final norm) against the same
    blocks called layer by layer with the module's final norm: the same tokens and the same
    logprobs to the bit, in float32 and in bfloat16 (where the rows between layers stay float32
    rounded to bfloat16 values instead of being narrowed and widened)."""
    monkeypatch.setenv(cpu_decode.ENV_VAR, "1")
    llm = LLM(str(model_factory("llama", num_layers=3)), kv_cache_memory=16 << 20, max_model_len=256, dtype=dtype)
    model = llm.engine.core.executor.model.model
    stack = model.cpu_decode_stack
    assert stack is not None and stack.final_norm and len(stack.blocks) == 3
    results = {}
    for name, choice in (("stack", stack), ("layers", None)):
        model.cpu_decode_stack = choice
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        results[name] = [(o.outputs[0].token_ids, [step[t] for step, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)]) for o in outs]
    assert results["stack"] == results["layers"]
    # A background-only step that may be given up runs the stack one call per layer, asking the
    # check before each (``FusedDecodeStack._abandonable``): never told to, it gives the same bits.
    model.cpu_decode_stack = stack
    asked: list[int] = []
    llm.engine.core.abandon_background_when(lambda: bool(asked.append(1)))
    try:
        results["abandonable"] = _background_run(llm)
    finally:
        llm.engine.core.abandon_background_when(None)
    assert results["abandonable"] == results["stack"] and len(asked) > 3 * PARAMS.max_tokens
    llm.shutdown()


def _background_run(llm: LLM) -> list[tuple]:
    """``PROMPTS`` as background requests on ``llm``'s engine: tokens and their logprobs."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS, background=True)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out.outputs[0]
    return [(o.token_ids, [step[t] for step, t in zip(o.logprobs, o.token_ids)]) for _, o in sorted(final.items())]
