"""scripts/bench_kernels.py runs end to end at tiny sizes (no timing assertions)."""

from __future__ import annotations

import json
import math

import pytest

from tests.scripts_module import load_script

pytestmark = pytest.mark.kernels


@pytest.mark.slow  # (CI time) a script's smoke run; bench_engine's quick run stays in the default run
def test_bench_smoke(tmp_path, capsys, monkeypatch):
    bench = load_script("bench_kernels", monkeypatch)
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    kinds = [row["kernel"] for row in result["rows"]]
    assert "decode" in kinds and "ragged" in kinds
    for row in result["rows"]:
        assert math.isfinite(row["ms"]) and row["ms"] > 0
        if row["kernel"] == "variant":  # the variants table: each variant against the plain kernel
            assert math.isfinite(row["vs_plain"]) and row["vs_plain"] > 0
        else:
            assert row.get("vs_xla") is not None
    variants = [row["variant"] for row in result["rows"] if row["kernel"] == "variant"]
    assert variants[0] == "plain" and {"int8 pages", "fp8 pages", "soft cap 50"} <= set(variants)
    assert any(name.startswith("window") for name in variants)
    out = capsys.readouterr().out
    assert "| decode |" in out and "| variant |" in out
