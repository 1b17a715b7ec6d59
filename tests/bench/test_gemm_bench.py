"""``pagoda bench gemm`` times torch's F.linear, oneDNN's packed weights and the dtype's decode
kernel where it runs (AMX for a bfloat16 model on an AMX CPU, else the bfloat16 panels with
AVX512-BF16; the panel kernel for a float32 one on an AVX-512 CPU; up to the rows it serves), on the model's shapes, and reports what each
computed."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagoda.bench import gemm
from pagoda.kernels import amx as cpu_amx
from pagoda.kernels import panel as cpu_panel
from pagoda.layers import cpu_gemm


@pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemm_command(llama_dir, tmp_path, capsys, dtype) -> None:
    out = tmp_path / "gemm.json"
    args = argparse.Namespace(model=str(llama_dir), dtype=dtype, tokens=[1, 16, 33], min_time=0.01,
                              output_json=str(out))
    assert gemm.run(args) == 0
    text = capsys.readouterr().out
    amx = dtype == "bfloat16" and cpu_amx.supported()
    key, label = ("amx", "AMX") if amx else ("panel", "panel")
    runs = amx or cpu_panel.supported(getattr(torch, dtype))
    # bfloat16 packs only with AVX512-BF16 or AMX; on an AVX2 CPU the layers keep F.linear.
    packable = cpu_gemm.pack(torch.zeros(16, 16, dtype=getattr(torch, dtype))) is not None
    assert (f"{label}/{'oneDNN' if packable else 'torch'}" in text) == runs
    report = json.loads(out.read_text())
    shapes = report["shapes"]
    assert report["onednn"] == packable and (report["speedup"] is not None) == packable
    assert ("oneDNN cannot pack" in text) == (not packable)
    assert {s["layer"] for s in shapes} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert [s["tokens"] for s in shapes[:3]] == [1, 16, 33]
    tol = 1e-3 if dtype == "float32" else 0.1
    for s in shapes:
        assert s["torch_s"] > 0
        assert ("onednn_s" in s) == packable
        if packable:
            assert s["onednn_s"] > 0 and s["max_abs_diff"] < tol
        assert (f"{key}_s" in s) == (runs and s["tokens"] <= 32)  # 33 rows: past what either serves
        if f"{key}_s" in s:
            assert s[f"{key}_s"] > 0 and s[f"{key}_max_abs_diff"] < tol
