"""The decode-graph path on the GPU code: Triton attention backend and fused ops, run through
the static buffers without capture. On CPU the kernels run under Triton's interpreter (see
conftest.py). The graph path pins the decode split count from max_model_len and pads the batch
with zero-length sequences; its logits must equal the ordinary Triton forward's. On an int8 or
fp8 KV cache (written by the CPU backend's prefill, read by the Triton kernels) they must also
equal the CPU backend's decode over the same quantized cache."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first ``import triton`` (see conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda.config import EngineArgs, EngineConfig  # noqa: E402
from pagoda.executor.cuda_graphs import DecodeGraphs  # noqa: E402
from pagoda.executor.model_runner import ModelRunner  # noqa: E402
from pagoda.layers.attention import triton_kernels as tk  # noqa: E402
from pagoda.layers.attention import triton_backend  # noqa: E402
from pagoda.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagoda.request import Request, Sequence  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.step import ScheduledSeq, SchedulerOutput  # noqa: E402

NEEDS_TRITON = True  # conftest: skip in-process if triton was imported too early
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
MAX_LEN = 1024  # long enough that the graph path splits the decode kernel


def _runner(model_dir, kv_cache_dtype: str = "auto", max_model_len: int | None = None, **options) -> ModelRunner:
    args = EngineArgs(model=str(model_dir), device=DEVICE, dtype="float32", block_size=BLOCK,
                      max_model_len=max_model_len or MAX_LEN, max_num_seqs=8, kv_cache_memory=8 << 20,
                      enforce_eager=True, kv_cache_dtype=kv_cache_dtype, **options)
    runner = ModelRunner(EngineConfig.from_args(args))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    return runner


def _prefilled(runner: ModelRunner, prompt_lens: list[int], adapters: list | None = None,
               room: int = 1) -> list[Sequence]:
    """Sequences with their prompts in the cache and one sampled token appended; each block table
    has room for ``room`` tokens past the prompt."""
    seqs, next_block = [], 1
    for i, n in enumerate(prompt_lens):
        prompt = [(7 * i + j) % 400 + 20 for j in range(n)]
        request = Request(f"r{i}", prompt, SamplingParams(temperature=0), (),
                          lora_request=adapters[i] if adapters else None)
        seq = Sequence(f"r{i}#0", request, list(prompt))
        blocks = -(-(n + room) // BLOCK)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, 0, s.num_tokens) for s in seqs], 0))
    runner.forward(inputs)
    for i, seq in enumerate(seqs):
        seq.token_ids.append(300 + i)
    return seqs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_static_buffer_decode_on_triton_matches_ordinary_forward(llama_dir, monkeypatch, kv_cache_dtype):
    runner = _runner(llama_dir, kv_cache_dtype)
    # Prompts go in with whatever backend the device has (on CPU, the fast torch one).
    seqs = _prefilled(runner, [300, 40, 7, 90, 129])
    cpu_backend = runner.model.attention_layers()[0].backend
    backend = TritonAttentionBackend()
    for layer in runner.model.attention_layers():
        layer.backend = backend
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    launches: list[int] = []
    real_decode = triton_backend.paged_decode_attention

    def spy(*args, **kwargs):
        launches.append(kwargs["num_splits"])
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 5))
    graphs = DecodeGraphs(runner, use_graphs=False)
    with torch.inference_mode():
        expected = runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices])
        got = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
    layers = len(runner.model.attention_layers())
    kv_heads = runner.model.attention_layers()[0].num_kv_heads
    pinned = tk.choose_num_splits(8, kv_heads, MAX_LEN, tk._device_sm_count(runner.device))
    assert pinned > 1
    # Eager steps choose per batch (None); the padded batch of 8 ran with the pinned count.
    assert launches == [None] * layers + [pinned] * layers
    assert backend.decode_num_splits is None  # restored for eager steps
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    if kv_cache_dtype != "auto":
        assert runner.kv_scales is not None and runner.kv_cache.element_size() == 1
        for layer in runner.model.attention_layers():
            layer.backend = cpu_backend
        with torch.inference_mode():
            on_cpu = runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices])
        torch.testing.assert_close(got, on_cpu, atol=1e-4, rtol=1e-4)


def test_greedy_round_on_triton_matches_step_by_step_decoding(llama_dir, monkeypatch):
    """A multi-step greedy round through the static buffers on the GPU code (Triton attention,
    the buffers loaded by the Triton kernel, moved on in place between steps, two rows crossing
    a block boundary mid-round): each step's tokens are the argmax of the ordinary forward's."""
    runner = _runner(llama_dir, max_model_len=64)  # few decode splits: the interpreter's time
    seqs = _prefilled(runner, [14, 5, 9], room=4)
    backend = TritonAttentionBackend()
    for layer in runner.model.attention_layers():
        layer.backend = backend
    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")
    graphs = DecodeGraphs(runner, use_graphs=False)

    def decode_inputs():
        return runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 0))[0]

    rows = graphs.greedy_round(decode_inputs(), 3, [frozenset()] * 3)
    assert graphs.runs == 3 and graphs.rounds == 1
    expected: list[list[int]] = [[] for _ in seqs]
    for _ in range(3):
        inputs = decode_inputs()
        with torch.inference_mode():
            tokens = runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices]).argmax(-1).tolist()
        for seq, row, token in zip(seqs, expected, tokens):
            seq.token_ids.append(token)
            row.append(token)
    assert rows == expected


def test_lora_rows_run_through_the_decode_graph_path(llama_dir, lora_adapters):
    """A LoRA engine's decode graphs hold the adapters' deltas: a batch mixing three adapters
    and the base model, padded from 5 rows to the captured size 8, gives the ordinary forward's
    logits (which take the segmented way); a step without adapter rows replays too."""
    from pagoda.lora.request import LoRARequest

    runner = _runner(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16)
    adapters = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(sorted(lora_adapters.items()))]
    for adapter in adapters:
        runner.add_lora(adapter)
    seqs = _prefilled(runner, [30, 4, 7, 19, 12], [adapters[0], None, adapters[1], adapters[2], adapters[0]])
    backend = TritonAttentionBackend()
    for layer in runner.model.attention_layers():
        layer.backend = backend
    graphs = DecodeGraphs(runner, use_graphs=False)
    assert graphs.buffers.lora_one_hot.shape == (8, 4)
    for step_seqs in (seqs, seqs[1:2]):  # mixed adapters; then the base model only
        inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in step_seqs], 0))
        assert graphs.can_run(inputs)
        with torch.inference_mode():
            expected = runner.model.compute_logits(runner.forward(inputs)[inputs.logits_indices])
            got = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # The adapters change the logits: the delta is really in the graph path.
    with torch.inference_mode():
        inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 0))
        with_lora = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
        inputs.lora_slots = None
        without = runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])
    changed = (with_lora - without).abs().amax(-1) > 1e-3
    assert changed.tolist() == [True, False, True, True, True]


def test_batch_one_decode_folds_the_norms_into_the_projections(model_factory, monkeypatch):
    """A Qwen3's batch-1 decode step on the GPU code (Triton backend and fused ops, the few-rows
    condition forced on CPU, float32) through the static buffers: the input norm rides in the qkv
    projection and the post-attention add + norm in the gate_up projection (two folds a layer,
    ``skinny_gemm.norm_linear``), with the logits of the same step unfolded."""
    from pagoda.layers import skinny_gemm as sg
    from pagoda.layers.linear import ColumnParallelLinear

    monkeypatch.setenv("PAGODA_FORCE_TRITON", "1")  # the layers as on a GPU (no fused CPU decode layer)
    monkeypatch.setenv("PAGODA_CPU_GEMM", "torch")  # weights left unpacked, as on a GPU
    runner = _runner(model_factory("qwen3"))
    seqs = _prefilled(runner, [21])
    backend = TritonAttentionBackend()
    for layer in runner.model.attention_layers():
        layer.backend = backend
    layers = runner.model.model.stage_layers
    assert all(layer.fold_attention and layer.fold_mlp for layer in layers)
    folded: list[bool] = []
    real = ColumnParallelLinear.forward_normed

    def spy(self, *args):
        out = real(self, *args)
        folded.append(out is not None)
        return out

    monkeypatch.setattr(ColumnParallelLinear, "forward_normed", spy)
    monkeypatch.setattr(sg, "applies", lambda x, w: x.shape[0] <= sg.MAX_ROWS)
    monkeypatch.setenv(sg.ENV, "triton")
    monkeypatch.setattr(sg, "CHOICE", sg.SkinnyChoice())  # reads the switch afresh
    inputs, _ = runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], 0))
    graphs = DecodeGraphs(runner, use_graphs=False)

    def step(fold: bool) -> torch.Tensor:
        for layer in layers:
            layer.fold_attention = layer.fold_mlp = fold
        with torch.inference_mode():
            return runner.model.compute_logits(graphs.run(inputs)[inputs.logits_indices])

    expected = step(False)
    assert folded == []
    got = step(True)
    assert folded == [True] * 2 * len(layers)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_rerun_in_fresh_process(rerun_module_in_fresh_process):
    rerun_module_in_fresh_process()
