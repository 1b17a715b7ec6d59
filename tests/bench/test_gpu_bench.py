"""``pagoda bench gpu``: it parses, refuses clearly without CUDA, its roofline arithmetic, and
the random-weight checkpoint writer (on tiny shapes, on CPU)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from pagoda.bench import gpu, gpu_model
from pagoda.bench.gpu_model import Shape, write_random_model
from pagoda.entrypoints.cli import build_parser, main
from pagoda.env_vars import GPU_DEVICE_FILES

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
                                  ["bench", "gpu", "throughput"], ["bench", "gpu", "attention"],
                                  ["bench", "gpu", "all"]])
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
    printed = capsys.readouterr().out
    assert "torch / triton" in printed and "generic decode, K = V = cache" in printed
    data = json.loads(report.read_text())
    results = data["results"]
    for step in ("decode", "prefill"):
        assert results[step]["triton_ms"] > 0 and results[step]["torch_ms"] > 0
        assert results[step]["max_abs_diff"] < 0.05  # bf16 outputs of one attention
    assert results["prefill"]["kernel_triton_ms"] > 0 and results["prefill"]["chosen"] == (
        ["triton"] if not torch.cuda.is_available() else results["prefill"]["chosen"])  # no flash kernel on CPU
    # The MLA table: every tile of the sweep timed, the latent kernel agreeing with the generic one.
    mla = data["mla_decode"]
    assert set(mla["tile_ms"]) == {"16x32", "32x32", "16x64", "32x64"} and mla["max_abs_diff"] < 0.05


# --------------------------------------------------------------------------------------
# bench gpu all
# --------------------------------------------------------------------------------------


def test_dummy_weights_are_drawn_in_place(tmp_path):
    """load_format=dummy: a directory with no weight file serves, with the same weights every
    time (seeded); the ordinary loader refuses it. Norm scales are ones, biases zero, matrices
    N(0, 1/fan_in), embeddings N(0, 0.02^2)."""
    from pagoda import LLM, SamplingParams
    from pagoda.models.loader import init_dummy_weights

    model = tmp_path / "m"
    gpu_model.write_shape_dir(model, TINY)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(model), device="cpu", dtype="float32", kv_cache_memory=4 << 20, load_format="dummy")
        runs.append(llm.generate([{"prompt_token_ids": [7, 100, 250]}], params, use_tqdm=False)[0].outputs[0].token_ids)
        llm.shutdown()
    assert runs[0] == runs[1] and len(runs[0]) == 6
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(model), device="cpu", kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(model), device="cpu", kv_cache_memory=4 << 20, load_format="random")

    net = torch.nn.Module()
    net.embed_tokens, net.proj, net.norm = torch.nn.Embedding(5000, 64), torch.nn.Linear(400, 300), torch.nn.LayerNorm(8)
    init_dummy_weights(net)
    assert net.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert net.proj.weight.std().item() == pytest.approx(400 ** -0.5, rel=0.05)
    assert torch.all(net.proj.bias == 0) and torch.all(net.norm.weight == 1) and torch.all(net.norm.bias == 0)


def _all_args(tmp_path, budget: float, dry_run: bool = True):
    import argparse

    return argparse.Namespace(budget_s=budget, output_json=str(tmp_path / "all.json"), dry_run=dry_run)


def test_dry_run_walks_through_every_stage(tmp_path, monkeypatch, capsys):
    """Every stage of the GPU run on CPU with tiny shapes: each prints its line as it ends, then
    one table; the JSON holds every stage, ok, with figures that agree with each other."""
    from pagoda.bench import gpu_all

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))  # the weightless shape directories
    report = tmp_path / "all.json"
    # A budget well above the nominal one: on CI's two busy cores the smoke stage alone has taken
    # 40 s of CPU-bound transformers work; stopping at allotments is tested on stub stages below.
    assert main(["bench", "gpu", "all", "--dry-run", "--budget-s", "1200", "--json", str(report)]) == 0
    assert gpu.DEVICE == "cuda"  # restored
    printed = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["finished"] and data["dry_run"] and data["elapsed_s"] < data["budget_s"]
    stages = {s["name"]: s for s in data["stages"]}
    assert list(stages) == [s.name for s in gpu_all.STAGES]
    assert {s["status"] for s in stages.values()} == {"ok"}, [(s["name"], s["status"], s.get("error"), s.get("reason"))
                                                              for s in data["stages"]]
    for name, s in stages.items():
        assert 0 <= s["seconds"] <= s["allotted_s"] + 5
        assert f"[gpu all] {name}: ok" in printed and printed.index(f"[gpu all] {name}") < printed.index("== pagoda")
    assert stages["smoke"]["result"]["passed"] and stages["smoke"]["result"]["tokens_checked"] == 16
    for name in ("roofline-qwen3-0.6b-bf16", "roofline-llama3-8b-bf16", "roofline-llama3-8b-fp8"):
        r = stages[name]["result"]
        assert r["async_scheduling"] and "async_error" not in r  # measured with the step ahead scheduled
        assert r["fraction"] == pytest.approx(r["decode_tokens_per_s"] / r["roofline_tokens_per_s"])
    # fp8 weights are a byte each: the fp8 model reads fewer bytes a step than the bf16 one.
    assert (stages["roofline-llama3-8b-fp8"]["result"]["weight_bytes_per_step"]
            < stages["roofline-llama3-8b-bf16"]["result"]["weight_bytes_per_step"])
    throughput = stages["throughput"]["result"]
    pagoda_runs = throughput["pagoda"]
    # The whole workload and the heads transformers may reach, with async scheduling, its steps profiled.
    assert set(pagoda_runs) == {"all", "2", "4", "async_scheduling", "step_profile"} and pagoda_runs["async_scheduling"]
    profile = pagoda_runs["step_profile"]
    # Every prompt token in some step's figures (prefix caching is off).
    assert profile["with_prompt_tokens"]["prompt_tokens"] == throughput["prompt_tokens"]
    decode = profile["decode_only"]
    assert 0 < decode["tokens"] < throughput["output_tokens"] and 0 < decode["roofline_fraction"]
    assert profile["all"]["steps"] >= profile["with_prompt_tokens"]["steps"] + decode["steps"]
    assert sum(b["steps"] for b in profile["decode_only_by_batch"].values()) == decode["steps"]
    assert profile["all"]["seconds"] <= pagoda_runs["all"]["elapsed_s"]
    assert not throughput["sync"]["async_scheduling"] and throughput["async_over_sync"] == pytest.approx(
        pagoda_runs["all"]["output_tokens_per_s"] / throughput["sync"]["all"]["output_tokens_per_s"])
    hf = stages["throughput-hf"]["result"]
    same = pagoda_runs["all"] if hf["num_seqs"] == 6 else pagoda_runs[str(hf["num_seqs"])]
    assert hf["output_tokens_per_s_ratio_vs_hf"] == pytest.approx(
        same["output_tokens_per_s"] / hf["hf"]["output_tokens_per_s"])
    assert stages["attention"]["result"]["results"]["decode"]["max_abs_diff"] < 0.05
    gemm = stages["fp8-gemms"]["result"]["gemms"]["tiny"]
    assert gemm["block_rel_err"] < 0.1 and gemm["channel_rel_err"] < 0.1 and gemm["block_ms"] > 0
    assert gemm["channel_quantize_ms"] > 0 and gemm["channel_matmul_ms"] > 0
    few = stages["fp8-gemms"]["result"]["few_rows"]["tiny/2"]  # the fp8 weight read as stored
    assert few["max_rel_err"] < 0.02 and few["best_us"] == min(c["us"] for c in few["configs"].values())
    assert few["w8a8_over_best"] == pytest.approx(few["w8a8_us"] / few["best_us"])
    prepare = stages["qkv-prepare"]["result"]["cases"]["tiny/2"]
    assert prepare["max_q_diff"] < 0.1 and prepare["max_cache_diff"] < 0.1 and prepare["fused_us"] > 0
    assert prepare["unfused_over_fused"] == pytest.approx(prepare["unfused_us"] / prepare["fused_us"])
    skinny = stages["skinny-gemm"]["result"]["cases"]["tiny-down/2"]
    assert skinny["max_rel_err"] < 0.05 and skinny["best_us"] == min(c["us"] for c in skinny["configs"].values())
    assert max(c["rel_err"] for c in skinny["silu_mul"]["configs"].values()) < 0.05
    splits = stages["decode-splits"]["result"]["cases"]["40"]
    assert set(splits["us"]) == {"1", "2"} and splits["fastest"] in splits["us"] and splits["eager_choice"] == 1
    host = stages["host-profile"]["result"]  # cProfile of the synchronous steps
    assert host["step_ms"] > 0 and len(host["functions"]) > 5
    assert host["batch_2"]["batch"] == 2 and host["batch_2"]["functions"]  # the dry plan's larger batch
    assert any(f["function"].startswith("pagoda/engine/core.py") for f in host["functions"]) or any(
        f["function"].startswith("pagoda/") for f in host["functions"])
    sync = stages["sync-watch"]["result"]  # no sync debug mode on CPU: the engine run alone
    assert sync["output_tokens"] == 2 * 6 and not sync["watched"]
    lora = stages["lora-graphs"]["result"]
    assert lora["same_greedy_fraction"] == 1.0 and lora["eager"]["tokens_per_s"] > 0
    assert lora["float32"]["same_greedy_fraction"] == 1.0 and lora["float32"]["max_logprob_diff"] < 1e-3
    mla = stages["mla-decode"]["result"]
    assert mla["max_abs_diff"] < 0.05 and mla["tile_ms"][mla["best_tile"]] == mla["mla_ms"]
    assert "fraction_of_copy" in mla and mla["ratio"] == pytest.approx(mla["generic_ms"] / mla["mla_ms"])
    assert "left_on_device" not in stages["smoke"]  # nothing on a CPU run's device
    for batch in (1, 2):  # async scheduling off and on, at the dry plan's batches
        r = stages["async-scheduling"]["result"][f"batch_{batch}"]
        assert r["ratio"] == pytest.approx(r["async"]["decode_tokens_per_s"] / r["sync"]["decode_tokens_per_s"])
    fp8 = stages["fp8-w8a8-llama3-8b-batch32"]["result"]  # W8A8 forced on CPU: the same kernels as on a card
    assert fp8["fp8"]["kernels"] == ["fp8_scaled_mm"] and fp8["bf16"]["kernels"] == [] and fp8["batch"] == 2
    assert fp8["ratio"] == pytest.approx(fp8["fp8"]["decode_tokens_per_s"] / fp8["bf16"]["decode_tokens_per_s"])
    assert 0 <= fp8["agreement_teacher_forced"] <= 1 and 0 <= fp8["agreement_free_running"] <= 1
    assert 0 <= fp8["agreement_teacher_forced_weight_only"] <= 1
    # On the trained built-in model W8A8 keeps bf16's greedy tokens almost everywhere (97.8% of
    # 16 x 64 positions on 2026-11-28; the dry run checks 8 x 32, 99.6%): a broken fp8 path would not.
    trained = fp8["trained"]
    assert trained["fp8_kernels"] == ["fp8_scaled_mm"] and trained["fp8"] >= 0.9 and trained["bf16_self"] >= 0.95
    assert "greedy agreement" in printed and "PAGODA_FP8_MATMUL" not in os.environ  # restored
    moe = stages["moe-graphs"]["result"]  # on CPU both runs are eager: the same tokens, no graphs
    assert moe["same_greedy_fraction"] == 1.0 and moe["max_logprob_diff"] == 0.0
    assert not moe["graphs"]["cuda_graphs"] and moe["eager"]["decode_tokens_per_s"] > 0
    steps = stages["roofline-qwen3-0.6b-bf16"]["result"]["steps"]  # every decode step's wall time
    assert steps["count"] >= 5 and 0 < steps["median_ms"] <= steps["max_ms"] and steps["slow"] >= 0
    fp8_kernels = stages["fp8-kernels"]["result"]  # batch-2 steps of the 8B shape's tiny stand-in
    assert fp8_kernels["fp8"]["quantization"] == "fp8" and fp8_kernels["bf16"]["quantization"] is None
    assert fp8_kernels["fp8"]["async_scheduling"] and fp8_kernels["fp8"]["kernels"]
    kernels = stages["decode-kernels"]["result"]
    assert kernels["steps"] == 4 and kernels["step_ms"] > 0 and kernels["kernels"]
    assert kernels["device_ms_per_step"] >= max(k["us_per_step"] for k in kernels["kernels"]) / 1000
    assert not kernels["async_scheduling"] and kernels["async"]["async_scheduling"]  # as the roofline runs
    assert kernels["async"]["steps"] == 4 and kernels["async"]["kernels"] and kernels["idle"] is None  # CPU
    with_pdl = stages["pdl"]["result"]  # no PDL on CPU: the same path twice, the same tokens
    assert not with_pdl["on"]["pdl"] and not with_pdl["off"]["pdl"] and with_pdl["same_greedy_fraction"] == 1.0
    assert with_pdl["on_over_off"] == pytest.approx(with_pdl["on"]["decode_tokens_per_s"]
                                                    / with_pdl["off"]["decode_tokens_per_s"])
    assert "PAGODA_PDL" not in os.environ  # restored
    rounds = stages["device-rounds"]["result"]  # through the static buffers on CPU: the GPU's round code
    small = rounds["qwen3-0.6b"]
    assert small["rounds"]["device_rounds"] > 0 and small["single"]["device_rounds"] == 0
    assert small["same_greedy_fraction"] == 1.0 and small["rounds_over_single"] == pytest.approx(
        small["rounds"]["decode_tokens_per_s"] / small["single"]["decode_tokens_per_s"])
    assert small["rounds_over_roofline_stage"] == pytest.approx(
        small["rounds"]["fraction"] / stages["roofline-qwen3-0.6b-bf16"]["result"]["fraction"])
    assert rounds["llama3-8b"]["rounds"]["device_rounds"] > 0 and "PAGODA_STATIC_DECODE" not in os.environ
    big = stages["decode-kernels-llama3-8b"]["result"]  # the 8B shape's tiny stand-in, async as its roofline
    assert big["shape"] == "llama3-8b" and big["async_scheduling"] and big["steps"] == 2 and big["kernels"]
    assert big["weights_ms_at_copy_rate"] == pytest.approx(
        1000 * big["weight_bytes_per_step"] / stages["device"]["result"]["copy_bandwidth_bytes_per_s"])
    assert big["weight_bytes_per_step"] == stages["roofline-llama3-8b-bf16"]["result"]["weight_bytes_per_step"]


def test_a_budget_too_small_skips_every_stage_with_its_reason(tmp_path, capsys):
    from pagoda.bench import gpu_all

    assert gpu_all.run_all(_all_args(tmp_path, budget=1.0)) == 0
    data = json.loads((tmp_path / "all.json").read_text())
    assert [s["name"] for s in data["stages"]] == [s.name for s in gpu_all.STAGES]
    assert all(s["status"] == "skipped" and "needs at least" in s["reason"] for s in data["stages"])
    table = capsys.readouterr().out
    assert all(s.name in table for s in gpu_all.STAGES) and "needs at least" in table


def test_budget_shares():
    from pagoda.bench.gpu_all import Stage, allotment, reserve_s

    stages = tuple(Stage(n, None, None, share, 0) for n, share in (("a", 10), ("b", 30), ("c", 60)))
    assert reserve_s(420) == 10 and reserve_s(20) == 1
    # Budget 210: 10 s kept back, the shares scaled to the other 200 (x2).
    assert allotment(stages, 0, 210, 210) == pytest.approx(20)
    # Time an earlier stage left unused goes to the next, beyond what the later shares need.
    assert allotment(stages, 1, 205, 210) == pytest.approx(195 - 120)
    assert allotment(stages, 1, 150, 210) == pytest.approx(60)  # after an overrun: the share still
    assert allotment(stages, 2, 201, 210) == pytest.approx(191)  # the last takes all that is left
    assert allotment(stages, 2, 50, 210) == pytest.approx(40)  # ... never the reserve


def test_stages_fail_stop_and_report_without_stopping_the_run(tmp_path, capsys):
    """A stage that raises is recorded with its error, one that runs past its allotment is
    stopped there (keeping what it measured), one that finds no path is 'not available', and
    the stages after them run; the JSON on disk is current after every stage."""
    from pagoda.bench import gpu_all
    from pagoda.bench.gpu_stages import NotAvailable

    seen = {}

    def ok(ctx, out):
        out["value"] = 1

    def fails(ctx, out):
        raise ValueError("no such kernel")

    def hangs(ctx, out):
        out["partial"] = 2
        while True:
            time.sleep(0.01)

    def lacks(ctx, out):
        raise NotAvailable("the card has no fp8")

    def later(ctx, out):
        raise AssertionError("a stage whose allotment is under its minimum ran")

    def reads_json(ctx, out):
        seen.update({s["name"]: s["status"] for s in json.loads((tmp_path / "all.json").read_text())["stages"]})
        out["stopped_stage_kept"] = ctx.results["hangs"]["partial"]

    stages = tuple(gpu_all.Stage(f.__name__, f, lambda out: "", share, least) for f, share, least in (
        (ok, 1, 0), (fails, 1, 0), (hangs, 1, 0), (lacks, 1, 0), (reads_json, 1, 0), (later, 100, 10**5)))
    def watchdog_exit(code):
        raise AssertionError("the hanging stage was not stopped at its allotment (~2 s)")

    assert gpu_all.run_all(_all_args(tmp_path, budget=60.0), stages, exit=watchdog_exit) == 1  # a stage failed
    records = json.loads((tmp_path / "all.json").read_text())["stages"]
    status = [(r["name"], r["status"]) for r in records]
    assert status == [("ok", "ok"), ("fails", "failed"), ("hangs", "stopped"), ("lacks", "not available"),
                      ("reads_json", "ok"), ("later", "skipped")]
    assert records[1]["error"] == "ValueError: no such kernel" and "allotment" in records[2]["reason"]
    assert records[2]["result"] == {"partial": 2} and records[4]["result"] == {"stopped_stage_kept": 2}
    assert seen == {"ok": "ok", "fails": "failed", "hangs": "stopped", "lacks": "not available",
                    "reads_json": "running", "later": "pending"}
    assert "no such kernel" in capsys.readouterr().out


def test_watchdog_ends_a_stuck_run_with_the_report_written(tmp_path, capsys):
    from pagoda.bench import gpu_all

    stages = (gpu_all.Stage("stuck", None, lambda out: "", 1, 0),)
    report = gpu_all.Report(stages, 0.2, False, str(tmp_path / "all.json"))
    report.records[0].update(status="running", allotted_s=0.1)
    exits = []
    gpu_all.Watchdog(report, time.monotonic(), 0.2, exit=exits.append)
    deadline = time.monotonic() + 30
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [3]
    record = json.loads((tmp_path / "all.json").read_text())["stages"][0]
    assert record["status"] == "stopped" and "budget" in record["reason"]
    assert "stuck" in capsys.readouterr().out


def test_transformers_stops_before_a_batch_past_its_deadline(tmp_path, monkeypatch):
    """The transformers side runs whole batches only while the next one's estimate fits."""
    from pagoda.bench.common import random_workload

    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    model = tmp_path / "m"
    gpu_model.write_shape_dir(model, TINY_TIED)
    work = random_workload(4, "5:20", "3:12", TINY_TIED.vocab_size, 0)
    out = gpu.hf_throughput(model, work, 2, deadline=time.monotonic(), probe_tokens=2)
    assert "num_seqs" not in out and out["stopped"].startswith("batch 1 ")  # (the dry run covers a whole run)


def test_transformers_stopped_mid_batch_keeps_the_ratio_of_the_batches_done(monkeypatch):
    from pagoda.bench import gpu_all
    from pagoda.bench import gpu_stages as st

    def one_batch_then_hang(model_dir, work, batch_size, deadline, out, probe_tokens):
        out.update(num_seqs=2, output_tokens_per_s=10.0)
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(gpu, "hf_throughput", one_batch_then_hang)
    monkeypatch.setattr(st, "_workload", lambda plan: (None, None))
    results = {"throughput": {"pagoda": {"all": {"output_tokens_per_s": 90.0}, "2": {"output_tokens_per_s": 50.0}}}}
    stage = next(s for s in gpu_all.STAGES if s.name == "throughput-hf")
    record = {}
    gpu_all.run_stage(stage, st.Ctx(st.DRY_PLAN, results, time.monotonic() + 0.3), record, 0.3)
    assert record["status"] == "stopped"
    assert record["result"]["output_tokens_per_s_ratio_vs_hf"] == 5.0 and record["result"]["num_seqs"] == 2
    assert "5.0x" in stage.summary(record["result"])


def test_teacher_forced_agreement_counts_the_models_own_choices(tmp_path):
    """The fp8 stage's agreement measure: a model agrees fully with its own greedy continuation,
    and not at a position whose token was replaced (the last one, so that no later position is
    judged on a changed prefix)."""
    from pagoda import LLM
    from pagoda.bench.gpu_fp8 import _greedy, teacher_forced_agreement

    model = tmp_path / "m"
    gpu_model.write_shape_dir(model, TINY)
    llm = LLM(str(model), device="cpu", dtype="float32", kv_cache_memory=4 << 20, load_format="dummy")
    try:
        prompts = [[7, 100, 250], [33, 34, 35, 36, 37]]
        own = _greedy(llm, prompts, 6)
        assert teacher_forced_agreement(llm, prompts, own) == 1.0
        changed = [r[:-1] + [(r[-1] + 1) % TINY.vocab_size] for r in own]
        assert teacher_forced_agreement(llm, prompts, changed) == pytest.approx(10 / 12)
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA's sync debug mode")
def test_sync_watch_names_the_line_that_waits():
    from pagoda.bench.gpu_sync import watch_syncs

    x = torch.ones(4, device="cuda")
    _, watched = watch_syncs(lambda: x.sum().item())
    assert watched["watched"] and watched["count"] >= 1
    assert list(watched["sites"]) == ["outside pagoda"]  # sites are pagoda's own frames; a test's is none


def test_step_stats_tell_stalls_from_a_uniform_rate():
    from pagoda.bench.common import step_stats

    assert step_stats([]) == {}
    uniform = step_stats([0.001] * 9 + [0.0011])
    assert uniform["slow"] == 0 and uniform["median_ms"] == pytest.approx(1.0)
    assert uniform["mean_ms"] == pytest.approx(1.01)
    assert uniform["max_ms"] == pytest.approx(1.1)
    stalls = step_stats([0.001] * 8 + [0.020, 0.011])
    assert stalls["slow"] == 2 and stalls["slow_excess_ms"] == pytest.approx(29.0)
    assert stalls["max_ms"] == pytest.approx(20.0)


@pytest.mark.skipif(any(os.path.exists(p) for p in GPU_DEVICE_FILES), reason="the dry run is the CPU's")
def test_the_command_line_dry_run_interprets_triton_by_itself(tmp_path):
    """``pagoda bench gpu all --dry-run`` from a shell (no ``TRITON_INTERPRET`` set, as the tests'
    conftest sets it): the fp8 stage calls Triton kernels on CPU tensors, which run only under
    the interpreter; the command switches it on before building its parser imports triton."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PAGODA_CACHE_DIR"] = str(tmp_path / "cache")
    report = tmp_path / "fp8.json"
    done = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "gpu", "all", "--dry-run",
                           "--budget-s", "600", "--stages", "fp8-gemms", "--json", str(report)],
                          env=env, capture_output=True, text=True, timeout=600)
    stages = {s["name"]: s for s in json.loads(report.read_text())["stages"]}
    assert done.returncode == 0 and stages["fp8-gemms"]["status"] == "ok", (done.stdout[-2000:], done.stderr[-2000:])


def test_the_interpreter_is_switched_on_only_without_a_gpu_or_a_choice(monkeypatch, tmp_path):
    from pagoda import env_vars

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(env_vars, "GPU_DEVICE_FILES", (str(tmp_path / "nvidia0"),))
    assert env_vars.interpret_triton_without_a_gpu() and os.environ["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the user's choice stands
    assert not env_vars.interpret_triton_without_a_gpu() and os.environ["TRITON_INTERPRET"] == "0"
    monkeypatch.delenv("TRITON_INTERPRET")
    (tmp_path / "nvidia0").touch()  # a GPU: its kernels compile for it
    assert not env_vars.interpret_triton_without_a_gpu() and "TRITON_INTERPRET" not in os.environ


def test_mla_sweep_keeps_the_tiles_measured_before_a_stop(monkeypatch):
    """A stage stopped at its allotment keeps what it measured: the MLA sweep writes each tile
    (the engine's own first, checked against float32) as it goes."""
    from pagoda.bench import gpu_attention

    class Stop(Exception):
        pass

    timed: list[int] = []

    def time_ms(fn, iters):
        if timed:
            raise Stop()  # the allotment ends during the second tile
        fn()
        timed.append(1)
        return 1.5

    monkeypatch.setattr(gpu_attention, "time_ms", time_ms)
    assert gpu_attention.MLA_TILES[0] == (32, 32)  # triton_mla's own tile for 128 heads on a card
    out: dict = {}
    with pytest.raises(Stop):
        gpu_attention.measure_mla_decode(1, 15, 1, 0, "cpu", heads=16, value_dim=32, rope_dim=16,
                                         tiles=((16, 16), (16, 32)), into=out)
    assert out["tile_ms"] == {"16x16": 1.5} and out["best_tile"] == "16x16" and out["mla_ms"] == 1.5
    assert out["diff_tile"] == "16x16" and out["max_abs_diff"] < 0.05 and out["latent_bytes_per_s"] > 0


def test_time_decode_counts_the_tokens_after_every_first_one(llama_dir, monkeypatch):
    """The roofline's decode phase, stepped as ``LLM.generate`` steps (finished requests'
    outputs only): it starts once every prompt has its first token and counts every token
    after, so the rate is tokens over the decode phase's time."""
    from pagoda import LLM

    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    llm = LLM(str(llama_dir), kv_cache_memory=8 << 20, max_model_len=128)
    try:
        steps: list[float] = []
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
        seconds, tokens = gpu.time_decode(llm, prompts, 9, steps)
        assert tokens == len(prompts) * 8 and seconds > 0 and len(steps) >= 1
        assert not llm.engine.output_processor.requests  # every request ended and left
    finally:
        llm.shutdown()
