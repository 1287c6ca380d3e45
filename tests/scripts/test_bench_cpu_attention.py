"""scripts/bench_cpu_attention.py runs end to end at tiny sizes (no timing assertions)."""

from __future__ import annotations

import logging
import math

import pytest

from pagedjax.device.cpu_attention import status
from tests.scripts_module import load_script


def test_rows_time_the_kernel_against_xlas_gather_path(monkeypatch, caplog):
    if not status().loaded:
        pytest.skip(f"the native attention kernel is not loaded: {status().reason}")
    caplog.set_level(logging.INFO)
    bench = load_script("bench_cpu_attention", monkeypatch)
    rows = bench.main(["--batches", "2", "--contexts", "40", "--dtypes", "float32", "bfloat16", "--layers", "2",
                       "--rounds", "1", "--calls", "1", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
                       "--block-size", "8"])
    assert [(r["dtype"], r["batch"], r["context"]) for r in rows] == [("float32", 2, 40), ("bfloat16", 2, 40)]
    assert all(math.isfinite(r[k]) and r[k] > 0 for r in rows for k in ("xla_ms", "native_ms", "speedup"))
    assert "| bfloat16 | 2 | 40 |" in caplog.text
