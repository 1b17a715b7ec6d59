"""``pagoda bench gpu``: it parses, refuses clearly without CUDA, its roofline arithmetic, and
the random-weight checkpoint writer (on tiny shapes, on CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from pagoda.bench import gpu, gpu_model
from pagoda.bench.gpu_model import Shape, write_random_model
from pagoda.entrypoints.cli import build_parser, main

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_roofline_parses():
    args = build_parser().parse_args(["bench", "gpu", "roofline", "--shape", "llama3-8b", "--batch", "4",
                                      "--output-len", "128"])
    assert (args.shape, args.batch, args.output_len, args.input_len, args.enforce_eager) == \
        ("llama3-8b", 4, 128, 128, False)
    args = build_parser().parse_args(["bench", "gpu", "roofline", "--shape", "qwen3-0.6b"])
    assert (args.batch, args.output_len) == (1, 256)


def test_throughput_parses():
    args = build_parser().parse_args(["bench", "gpu", "throughput", "--skip-hf", "--enforce-eager"])
    assert (args.num_seqs, args.hf_batch_size, args.skip_hf, args.enforce_eager) == (256, 64, True, True)


@pytest.mark.parametrize("argv", [["bench", "gpu"], ["bench", "gpu", "roofline"],
                                  ["bench", "gpu", "roofline", "--shape", "llama-70b"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


@no_cuda
@pytest.mark.parametrize("argv", [["bench", "gpu", "roofline", "--shape", "qwen3-0.6b"],
                                  ["bench", "gpu", "throughput"], ["bench", "gpu", "attention"]])
def test_refuses_without_cuda(argv, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a checkpoint was built on a machine that cannot run the benchmark")

    monkeypatch.setattr(gpu, "bench_shape_dir", no_model)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err


def test_decode_roofline_arithmetic():
    # Two decode steps at contexts 101 and 102: 2 GB of weights + 203 tokens of 100 KB.
    best = gpu.decode_roofline(1e12, 10**9, 10**5, batch=1, prompt_len=100, output_len=3)
    assert best == pytest.approx(2 / ((2e9 + 203e5) / 1e12))
    # A batch shares the weight reads: 4 sequences cost far less than 4 times one.
    assert gpu.decode_roofline(1e12, 10**9, 10**5, 4, 100, 3) > 3.5 * best


TINY = Shape("llama", 64, 2, 4, 2, 16, 128, 300, False, 256, 10000.0,
             {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64})
TINY_TIED = Shape("qwen3", 64, 2, 4, 2, 32, 96, 300, True, 256, 1000000.0)


@pytest.mark.parametrize("shape", [TINY, TINY_TIED], ids=["llama3-like", "qwen3-like"])
def test_written_checkpoint_loads_in_pagoda_and_transformers(tmp_path, shape):
    from transformers import AutoModelForCausalLM

    from pagoda import LLM, SamplingParams

    out = write_random_model(tmp_path / "m", shape, torch.device("cpu"), shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert ("lm_head.weight" in index["weight_map"]) == (not shape.tie_embeddings)
    llm = LLM(str(out), device="cpu", dtype="float32", kv_cache_memory=4 << 20)  # as transformers below
    assert llm.config.model.dtype == torch.float32 and llm.config.model.tie_word_embeddings == shape.tie_embeddings
    prompt = [7, 100, 250, 33]
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    runner = llm.engine.core.executor
    weights = gpu.weight_bytes_per_step(runner.model)
    llm.shutdown()
    # The word-level tokenizer decodes whatever the model emits.
    assert got.outputs[0].text.split() == [f"t{t}" for t in got.outputs[0].token_ids if t >= 6]
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                          max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert got.outputs[0].token_ids == ref
    # One decode step reads every weight once; an untied embedding table only by rows.
    embed = shape.vocab_size * shape.hidden_size * 4
    total = sum(p.numel() * 4 for p in hf.parameters())  # transformers lists a tied weight once too
    assert weights == (total if shape.tie_embeddings else total - embed)


def test_commands_walk_through_on_cpu(tmp_path, monkeypatch, capsys):
    """Both commands end to end on a tiny weightless shape on CPU (engines moved off the GPU, the
    copy bandwidth stubbed): they run, report and write their JSON."""
    model = tmp_path / "m"
    gpu_model.write_shape_dir(model, TINY_TIED)  # no weights: both engines draw their own
    assert not list(model.glob("*.safetensors"))
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "cuda_missing", lambda: None)
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda: 1e11)
    monkeypatch.setattr(gpu, "bench_shape_dir", lambda name: model)
    report = tmp_path / "roofline.json"
    assert main(["bench", "gpu", "roofline", "--shape", "qwen3-0.6b", "--batch", "2", "--input-len", "12",
                 "--output-len", "10", "--output-json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["decode_tokens_per_s"] > 0 and data["fraction"] == pytest.approx(
        data["decode_tokens_per_s"] / data["roofline_tokens_per_s"])
    assert "fraction of roofline" in capsys.readouterr().out
    report = tmp_path / "throughput.json"
    assert main(["bench", "gpu", "throughput", "--num-seqs", "4", "--input-len", "5:20", "--output-len", "3:12",
                 "--hf-batch-size", "2", "--output-json", str(report)]) == 0
    assert "pagoda / hf output tok/s" in capsys.readouterr().out
    assert json.loads(report.read_text())["output_tokens_per_s_ratio_vs_hf"] > 0


def test_shapes_match_the_published_models():
    llama, qwen = gpu_model.SHAPES["llama3-8b"], gpu_model.SHAPES["qwen3-0.6b"]
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.intermediate_size,
            llama.vocab_size, llama.tie_embeddings) == (4096, 32, 32, 8, 14336, 128256, False)
    assert llama.rope_scaling["rope_type"] == "llama3"
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim,
            qwen.intermediate_size, qwen.vocab_size, qwen.tie_embeddings) == (1024, 28, 16, 8, 128, 3072, 151936, True)


def test_attention_command_walks_through(tmp_path, monkeypatch, capsys):
    """The backend comparison on tiny steps: on CPU the Triton kernels run under the interpreter
    (which the suite turns on only where there is no GPU), on a GPU machine compiled for it.
    Both backends run the same attention, and the report says so."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(gpu, "DEVICE", "cpu")
        monkeypatch.setattr(gpu, "cuda_missing", lambda: None)
    report = tmp_path / "attention.json"
    assert main(["bench", "gpu", "attention", "--decode-seqs", "2", "--decode-context", "19", "--prefill-seqs", "1",
                 "--prefill-len", "9", "--iters", "1", "--output-json", str(report)]) == 0
    assert "torch / triton" in capsys.readouterr().out
    results = json.loads(report.read_text())["results"]
    for step in ("decode", "prefill"):
        assert results[step]["triton_ms"] > 0 and results[step]["torch_ms"] > 0
        assert results[step]["max_abs_diff"] < 0.05  # bf16 outputs of one attention
