"""``pagoda bench block-tables`` builds each cell with both builders, finds their tensors equal and
reports both times and their ratio."""
from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.cli import main


def test_block_tables_command(tmp_path, capsys) -> None:
    out = tmp_path / "tables.json"
    argv = ["bench", "block-tables", "--contexts", "20,70", "--batches", "1,3", "--rounds", "1",
            "--min-time", "0", "--output-json", str(out)]
    assert main(argv) == 0
    assert "same tensors" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [(r["context"], r["batch"]) for r in results] == [(20, 1), (20, 3), (70, 1), (70, 3)]
    for r in results:
        assert r["same_tensors"] and r["old_us_per_seq_step"] > 0 and r["new_us_per_seq_step"] > 0
        assert r["ratio"] == pytest.approx(r["new_us_per_seq_step"] / r["old_us_per_seq_step"])
