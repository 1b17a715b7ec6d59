"""``pagoda bench quantization`` end to end on a tiny checkpoint: the variants' decode speed, the
prefill of one long prompt with its ratio to float32, and quality, in the JSON it writes."""
from __future__ import annotations

import json

from pagoda.entrypoints.cli import build_parser


def test_quantization_bench_times_prefill_beside_decode(llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "quant.json"
    args = build_parser().parse_args([
        "bench", "quantization", "--model", str(llama_dir), "--variants", "fp32,bf16,int8",
        "--batch-sizes", "1,2", "--rounds", "2", "--output-len", "4", "--prefill-len", "48",
        "--kv-cache-memory", str(16 << 20), "--max-model-len", "256", "--output-json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["prefill_len"] == 48
    assert set(result["prefill_tokens_per_s"]) == {"fp32", "bf16", "int8"}
    assert all(v > 0 for v in result["prefill_tokens_per_s"].values())
    assert set(result["tokens_per_s"]["int8"]) == {"1", "2"}
    assert result["quality"]["fp32"]["mean_kl"] < 1e-9 < result["quality"]["int8"]["mean_kl"]
    text = capsys.readouterr().out
    assert "prefill 48 tok/s (x fp32)" in text and "bf16: prefill of 48 tokens" in text
