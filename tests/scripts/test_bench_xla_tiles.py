"""scripts/bench_xla_tiles.py runs end to end at tiny sizes (no timing assertions)."""

from __future__ import annotations

import logging
import math

from tests.scripts_module import load_script


def test_rows_time_each_tile_against_tiles_of_16(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    bench = load_script("bench_xla_tiles", monkeypatch)
    rows = bench.main(["--rows", "64", "--context", "80", "--tiles", "32", "--dtypes", "float32", "--rounds", "1",
                       "--calls", "1", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--block-size", "8"])
    assert [r["q_tile"] for r in rows] == [16, 32]
    assert all(math.isfinite(r["ms"]) and r["ms"] > 0 for r in rows) and rows[0]["vs_16"] == 1.0
    assert "| float32 | 32 (default) |" in caplog.text  # default_q_tile(64, 1)
