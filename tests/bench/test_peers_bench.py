"""``pagoda bench peers`` without llama.cpp: the GGUF export read back with gguf's own reader, the
rotary permutation it applies, the roofline arithmetic, the command end to end on a tiny model
with llama.cpp reported absent, and a peer killed by a signal."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pagoda.bench import gguf_export, peers, peers_report


def test_gguf_export_reads_back_with_gguf_reader(llama_dir, tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    original = dict(gguf_export.hf_tensors(llama_dir))
    path = gguf_export.write_gguf(llama_dir, tmp_path / "m-f32.gguf", "f32")
    back = gguf_export.read_gguf(path)
    assert set(back) == {gguf_export.gguf_name(n) for n in original}
    for name, arr in original.items():  # f32 is exact, Q/K un-permuted back to the HF layout
        assert np.array_equal(back[gguf_export.gguf_name(name)], arr), name

    reader = gguf.GGUFReader(str(path))
    cfg = json.loads((llama_dir / "config.json").read_text())
    assert int(reader.fields["llama.block_count"].contents()) == cfg["num_hidden_layers"]
    assert int(reader.fields["llama.attention.head_count_kv"].contents()) == cfg["num_key_value_heads"]
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == cfg["vocab_size"]

    q8 = gguf_export.read_gguf(gguf_export.write_gguf(llama_dir, tmp_path / "m-q8.gguf", "q8_0"))
    for name, arr in original.items():
        got = q8[gguf_export.gguf_name(name)]
        if arr.ndim == 1:
            assert np.array_equal(got, arr)  # norms stay float32
        else:  # 8-bit per block of 32: half a step, plus the fp16 rounding of the block's scale
            step = np.abs(arr).max() / 127  # the largest block scale
            assert np.abs(got - arr).max() <= step * (0.5 + 127 * 2.0 ** -11), name
    with pytest.raises(ValueError, match="ftype"):
        gguf_export.write_gguf(llama_dir, tmp_path / "x.gguf", "q3")


def test_rope_permutation_turns_half_split_rotary_into_interleaved() -> None:
    """Rotating W x in transformers' layout (pairs i, i + d/2) equals rotating (P W) x in the
    interleaved layout (pairs 2i, 2i + 1) and un-permuting: what llama.cpp computes."""
    rng = np.random.default_rng(0)
    heads, d, hidden = 2, 8, 5
    w, x = rng.normal(size=(heads * d, hidden)), rng.normal(size=hidden)
    theta = rng.uniform(0, 3, size=d // 2)
    cos, sin = np.cos(theta), np.sin(theta)

    def half_split(v: np.ndarray) -> np.ndarray:
        a, b = v[: d // 2], v[d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin])

    def interleaved(v: np.ndarray) -> np.ndarray:
        a, b = v[0::2], v[1::2]
        out = np.empty_like(v)
        out[0::2], out[1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    hf = np.concatenate([half_split(h) for h in (w @ x).reshape(heads, d)])
    permuted = gguf_export.rope_permute(w, heads)
    llama = np.concatenate([interleaved(h) for h in (permuted @ x).reshape(heads, d)])
    back = gguf_export.rope_unpermute(llama[:, None], heads)[:, 0]
    np.testing.assert_allclose(back, hf, rtol=1e-12, atol=1e-12)
    assert np.array_equal(gguf_export.rope_unpermute(permuted, heads), w)


def test_roofline_arithmetic_on_the_issue_model_shape(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": 32000}))
    counts = peers.weight_counts(str(tmp_path))
    # per layer: qkv 512x1024, o 512x512, gate/up/down 3 x 512x1408
    assert counts == {"body": 8 * (512 * 1024 + 512 * 512 + 3 * 512 * 1408), "head": 32000 * 512,
                      "vectors": 17 * 512}
    fp32 = peers.bytes_per_token(counts, 4, 4)
    assert fp32 == pytest.approx(159.9e6, rel=1e-3)  # the issue's "160 MB per token"
    assert peers_report.roofline_tok_s(38e9, fp32) == pytest.approx(237.6, rel=1e-3)  # its ~240 tok/s
    # the bench quantizes pagoda's LM head as Q8_0 does; without {"lm_head": true} it stays float32
    int8 = peers.pagoda_bytes_per_token(counts, peers.PRECISIONS["int8"])
    assert int8 == (counts["body"] + counts["head"]) * 1 + counts["vectors"] * 4
    float_head = dataclasses.replace(peers.PRECISIONS["int8"], pagoda={"dtype": "float32", "quantization": "int8"})
    assert peers.pagoda_bytes_per_token(counts, float_head) == counts["body"] + counts["head"] * 4 + counts["vectors"] * 4
    q8 = peers.bytes_per_token(counts, peers.GGUF_BYTES["q8_0"], peers.GGUF_BYTES["q8_0"])
    assert math.isclose(q8, (counts["body"] + counts["head"]) * 34 / 32 + counts["vectors"] * 4)


@pytest.mark.parametrize("ftype,per_weight", [("q4_0", 18 / 32), ("q8_0", 34 / 32)])
def test_gguf_rooflines_count_the_files_tensor_types(llama_dir, tmp_path, ftype, per_weight) -> None:
    """``-gguf`` precisions: llama.cpp reads each tensor's size in the file, pagoda the storage of
    the kernel the type lands on (Q4_0: symmetric int4 in groups of 32, Q8_0: int8 in groups of
    32, a float16 scale per group, the output matrix too: the file's own bytes); the token
    embedding is left out."""
    path = gguf_export.write_gguf(llama_dir, tmp_path / f"m-{ftype}.gguf", ftype)
    counts = peers.weight_counts(str(llama_dir))
    got = peers.gguf_bytes_per_token(path)
    matrices = counts["body"] + counts["head"]
    assert got["llama.cpp"] == matrices * per_weight + counts["vectors"] * 4
    assert got["pagoda"] == got["llama.cpp"]


def test_q4_k_m_without_llama_cpp_is_refused_by_name(llama_dir, tmp_path, monkeypatch, capsys) -> None:
    """The Q4_K_M file comes from llama.cpp's own quantizer: with llama-cpp-python absent the
    precision is refused, saying what it needs, and nothing is written; a file already in the
    cache is used as it is."""
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    with pytest.raises(peers.QuantizerMissing, match="needs llama.cpp's own quantizer"):
        peers.gguf_path(tmp_path, str(llama_dir), "q4_k_m")
    assert list(tmp_path.iterdir()) == []
    args = argparse.Namespace(
        model=str(llama_dir), batch_sizes=[1], input_len=12, output_len=4, prefill_len=24, prefill_reps=1,
        precisions=["q4_k_m-gguf"], engines=["pagoda", "llama.cpp"], threads=None, gguf_dir=str(tmp_path), seed=0,
        bandwidth_mib=8, plot=None, output_json=None, rounds=1)
    assert peers.run(args) == 1  # the only precision asked for was refused: nothing ran
    text = capsys.readouterr().out
    assert "skipping q4_k_m-gguf: q4_k_m needs llama.cpp's own quantizer" in text
    assert "pip install llama-cpp-python" in text
    q4_0 = peers.gguf_path(tmp_path, str(llama_dir), "q4_0")
    cached = q4_0.rename(q4_0.with_name(q4_0.name.replace("-q4_0.", "-q4_k_m.")))  # as if written earlier
    assert peers.gguf_path(tmp_path, str(llama_dir), "q4_k_m") == cached


def test_peers_command_runs_without_llama_cpp(llama_dir, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    out = tmp_path / "peers.json"
    args = argparse.Namespace(
        model=str(llama_dir), batch_sizes=[1, 2], input_len=12, output_len=6, prefill_len=24, prefill_reps=1,
        precisions=["fp32", "int8"], engines=["pagoda", "hf", "llama.cpp"], threads=None, gguf_dir=str(tmp_path),
        seed=0, bandwidth_mib=8, plot=str(tmp_path / "peers.png"), output_json=str(out), rounds=2)
    assert peers.run(args) == 0
    text = capsys.readouterr().out
    assert "round 2 of 2" in text and "median of 2 rounds" in text
    assert "pip install llama-cpp-python" in text
    result = json.loads(out.read_text())
    rows = {(r["engine"], r["precision"]): r for r in result["rows"]}
    assert {("pagoda", "fp32"), ("hf", "fp32")} <= set(rows)
    assert not any(e == "llama.cpp" for e, _ in rows)
    for r in rows.values():
        assert set(r["decode_tok_s"]) == {"1", "2"} and all(v > 0 for v in r["decode_tok_s"].values())
        assert r["prefill_tok_s"] > 0 and r["roofline_b1_tok_s"] > 0
        # each engine's own roofline: the streaming read measured next to its run
        assert r["run_bandwidth"] > 0
        assert r["share_b1_at_run"] == pytest.approx(
            r["decode_tok_s"]["1"] * r["bytes_per_token"] / r["run_bandwidth"])
    assert "share b1 at run" in text
    assert 0 <= rows[("pagoda", "fp32")]["engine_overhead"] < 1
    ratio = next(x for x in result["ratios"] if x["peer"] == "hf" and x["precision"] == "fp32")
    assert len(ratio["rounds"]["decode"]) == 2 and ratio["decode"]["1"] > 0
    assert rows[("pagoda", "fp32")]["greedy"] == rows[("hf", "fp32")]["greedy"]  # same tokens, same model
    assert result["greedy_mismatch_fp32"] == []
    assert len(rows[("pagoda", "fp32")]["greedy"]) == 6
    if ("pagoda", "int8") not in rows:  # before pagoda has --quantization, said rather than dropped
        assert any("int8" in s for s in result["skipped"])
    bw = result["bandwidth_bytes_s"]
    # measured before and after the run; the roofline takes the best of both
    assert bw["best"] == max(bw["best_before"], bw["best_after"]) > 0
    assert {"sum_before", "matvec_before", "sum_after"} <= set(bw)
    assert (tmp_path / "peers.png").exists()


def test_peers_runs_pagoda_on_the_gguf_llama_cpp_runs(llama_dir, tmp_path, monkeypatch) -> None:
    """``--precisions q4_0-gguf``: pagoda loads the GGUF file written for llama.cpp (not the
    checkpoint), and its greedy tokens are those of pagoda on that file."""
    from pagoda import LLM, SamplingParams

    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    loaded = []
    real = peers.run_pagoda
    monkeypatch.setattr(peers, "run_pagoda", lambda model, *a, **k: loaded.append(model) or real(model, *a, **k))
    out = tmp_path / "peers.json"
    args = argparse.Namespace(
        model=str(llama_dir), batch_sizes=[1], input_len=12, output_len=6, prefill_len=24, prefill_reps=1,
        precisions=["q4_0-gguf"], engines=["pagoda"], threads=None, gguf_dir=str(tmp_path), seed=0,
        bandwidth_mib=8, plot=None, output_json=str(out), rounds=1)
    assert peers.run(args) == 0
    assert len(loaded) == 1 and loaded[0].endswith("-q4_0.gguf") and Path(loaded[0]).parent == tmp_path
    row = next(r for r in json.loads(out.read_text())["rows"] if r["precision"] == "q4_0-gguf")
    batches, _ = peers.make_prompts([1], 12, 24, 1, 512, 0)
    llm = LLM(loaded[0], kv_cache_memory=8 << 20, max_model_len=256, dtype="float32", enable_prefix_caching=False)
    try:
        ref = llm.generate([{"prompt_token_ids": batches[1][0]}],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert row["greedy"] == ref[0].outputs[0].token_ids


def test_a_peer_killed_by_sigill_is_named_and_llama_cpp_reruns_without_extra_buffers(monkeypatch, capsys) -> None:
    import signal

    jobs = []

    def child(job):
        jobs.append(job)
        if job.get("extra_bufts", True):
            raise peers.PeerCrashed(job["engine"], signal.SIGILL, "load_tensors: AMX model buffer\n")
        return {"decode_tok_s": {"1": 1.0}, "prefill_tok_s": 2.0}

    monkeypatch.setattr(peers, "run_child", child)
    skipped: list[str] = []
    result = peers._peer({"engine": "llama.cpp"}, skipped)
    assert [j.get("extra_bufts", True) for j in jobs] == [True, False]
    assert result is not None and result["extra_bufts"] is False and not skipped
    text = capsys.readouterr().out
    assert "killed by SIGILL" in text and "AMX_INT8=OFF" in text
    # Another engine's crash is reported and skipped, not retried.
    jobs.clear()
    assert peers._peer({"engine": "hf"}, skipped) is None
    assert len(jobs) == 1 and "killed by SIGILL" in skipped[0]


def test_rounds_merge_to_medians_and_ratios_to_the_median_of_each_rounds_ratio() -> None:
    def row(engine, b1, prefill, overhead=None, bw=None):
        return peers_report.Row(engine, "fp32", {1: b1}, prefill, bytes_per_token=1e9, engine_overhead=overhead,
                                run_bandwidth=bw)

    rounds = [[row("pagoda", 100.0, 10.0, 0.1, 200e9), row("llama.cpp", 50.0, 10.0)],
              [row("pagoda", 60.0, 30.0, 0.3, 100e9), row("llama.cpp", 60.0, 10.0)],
              [row("pagoda", 90.0, 20.0, 0.2, 120e9), row("llama.cpp", 30.0, 40.0)]]
    merged = {r.engine: r for r in peers_report.merge_rounds(rounds)}
    assert merged["pagoda"].decode_tok_s == {1: 90.0} and merged["pagoda"].prefill_tok_s == 20.0
    # the median run bandwidth (120 GB/s) is the merged row's roofline: 90 tok/s of 120
    assert merged["pagoda"].run_bandwidth == 120e9 and peers_report.run_share(merged["pagoda"]) == 0.75
    assert merged["llama.cpp"].run_bandwidth is None and peers_report.run_share(merged["llama.cpp"]) is None
    assert merged["pagoda"].engine_overhead == 0.2 and merged["llama.cpp"].decode_tok_s == {1: 50.0}
    (ratio,) = peers_report._round_ratios(rounds, [1])
    # per round 2.0, 1.0, 3.0 -> 2.0; the ratio of the medians would be 90 / 50 = 1.8
    assert ratio["decode"] == {1: 2.0} and ratio["rounds"]["decode"] == [{1: 2.0}, {1: 1.0}, {1: 3.0}]
    assert ratio["prefill"] == 1.0  # 1.0, 3.0, 0.5
    assert peers_report.merge_rounds(rounds[:1]) == rounds[0]


def test_bandwidth_buffer_is_past_the_last_level_cache(monkeypatch, tmp_path):
    """The roofline's bandwidth is read from a buffer no cache holds: twice the largest cache
    sysfs reports when that is more than 256 MiB (a 300 MiB L3 would hold a 256 MiB buffer)."""
    from pagoda.bench import peers

    for name, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    real = peers.Path
    monkeypatch.setattr(peers, "Path", lambda p, *a: real(tmp_path) if p == "/sys/devices/system/cpu/cpu0/cache" else real(p, *a))
    assert peers.last_level_cache_bytes() == 300 << 20
    assert peers.default_bandwidth_mib() == 600
    (tmp_path / "index3" / "size").write_text("32768K\n")
    assert peers.default_bandwidth_mib() == 256


def test_pagoda_under_a_forced_kernel_variant_is_a_peer(llama_dir, tmp_path, monkeypatch, capsys) -> None:
    """``--engines pagoda,pagoda@scalar``: pagoda in a child process under ``PAGODA_CPU_ISA=scalar``,
    its own row and a printed ratio beside the in-process pagoda; the same greedy tokens in
    float32 (the variants agree to float32 rounding); a level the CPU lacks is skipped and said.
    ``pagoda@visible-cpus`` (a thread per CPU of the affinity mask) is a child peer the same way."""
    from pagoda.kernels import select

    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    missing = [lvl for lvl in select.LEVELS if lvl not in select.supported_levels()]
    engines = ["pagoda", "pagoda@scalar", "pagoda@visible-cpus"] + [f"pagoda@{lvl}" for lvl in missing[:1]]
    out = tmp_path / "peers.json"
    args = argparse.Namespace(
        model=str(llama_dir), batch_sizes=[1, 2], input_len=12, output_len=6, prefill_len=24, prefill_reps=1,
        precisions=["fp32"], engines=engines, threads=None, gguf_dir=str(tmp_path), seed=0, bandwidth_mib=8,
        plot=None, output_json=str(out), rounds=1)
    assert peers.run(args) == 0
    text = capsys.readouterr().out
    assert "-- pagoda@scalar fp32" in text and f"pagoda runs the {select.isa().variant} kernel variant" in text
    result = json.loads(out.read_text())
    rows = {(r["engine"], r["precision"]): r for r in result["rows"]}
    assert set(rows) == {("pagoda", "fp32"), ("pagoda@scalar", "fp32"), ("pagoda@visible-cpus", "fp32")}
    assert rows[("pagoda@scalar", "fp32")]["greedy"] == rows[("pagoda", "fp32")]["greedy"]
    assert rows[("pagoda@visible-cpus", "fp32")]["greedy"] == rows[("pagoda", "fp32")]["greedy"]
    ratio = next(x for x in result["ratios"] if x["peer"] == "pagoda@scalar")
    assert ratio["decode"]["1"] > 0 and ratio["prefill"] > 0
    if missing:
        assert any(f"pagoda@{missing[0]}" in s for s in result["skipped"])


def test_a_q4_k_m_files_roofline_counts_each_layers_kernel(model_factory, tmp_path) -> None:
    """A Q4_K_M-like file: pagoda reads Q4_K on int4 (0.625 bytes a weight), Q6_K on int8 in
    groups of 16 (1.125, the head too) and the q/k/v fusing Q4_K with a Q6_K v as int8 per channel
    (a byte a weight, 8 a row); llama.cpp each tensor's bytes in the file."""
    import gguf

    from tests.models.gguf_helpers import export, per_layer

    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
             "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
    model = model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path = export(model, tmp_path / "m.gguf", "f32", {**per_layer(types, 2), "output.weight": "Q6_K"})
    per_weight = {"attn_output": 0.625, "ffn_gate": 0.625, "ffn_up": 0.625, "ffn_down": 1.125, "output": 1.125}
    want = {"llama.cpp": 0.0, "pagoda": 0.0}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            continue
        want["llama.cpp"] += int(t.n_bytes)
        if len(t.shape) == 1:
            want["pagoda"] += 4 * int(t.n_elements)
            continue
        rows, kind = int(t.shape[1]), t.name.split(".")[-2]
        fused = kind in ("attn_q", "attn_k", "attn_v")
        want["pagoda"] += int(t.n_elements) + 8 * rows if fused else int(t.n_elements) * per_weight[kind]
    assert peers.gguf_bytes_per_token(path) == pytest.approx(want, rel=1e-12)
