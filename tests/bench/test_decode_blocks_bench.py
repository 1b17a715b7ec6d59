"""``pagoda bench decode-blocks`` runs both sides in one engine and reports the same tokens."""
from __future__ import annotations

import argparse
import json

import pytest

from pagoda.bench import decode_blocks
from pagoda.models import cpu_decode


@pytest.mark.skipif(cpu_decode.load() is None, reason="the fused decode kernel cannot be built here")
def test_decode_blocks_command(llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "blocks.json"
    args = argparse.Namespace(model=str(llama_dir), quantization=None, batch_sizes=[1, 3], input_len=10,
                              output_len=5, rounds=1, seed=0, output_json=str(out))
    assert decode_blocks.run(args) == 0
    assert "2 of 2 layers have fused blocks (2 with their MLP)" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in results] == [1, 3]
    for r in results:
        assert r["same_tokens"] and r["on_s_per_step"] > 0 and r["off_s_per_step"] > 0
        assert r["ratio"] == pytest.approx(r["on_s_per_step"] / r["off_s_per_step"])
