"""Smoke test of scripts/bench_int8_matmul.py --quick (no timing assertions): every row count's row, the kernel's
products checked equal to XLA's before timing."""

from __future__ import annotations

import pytest

from pagedjax.device.int8_matmul import native_status
from tests.scripts_module import SCRIPTS, load_script


def test_bench_int8_matmul_quick(capsys, monkeypatch):
    if not native_status().loaded:
        pytest.skip(f"the native kernel is not loaded: {native_status().reason}")
    monkeypatch.syspath_prepend(str(SCRIPTS))  # its sibling bench_engine (the 156M shape)
    bench = load_script("bench_int8_matmul", monkeypatch)
    bench.main(["--quick", "--rows", "1,3"])
    out = capsys.readouterr().out
    assert f"({native_status().isa} kernel)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("small ")]
    assert [r[1] for r in rows] == ["1", "3"] and all(len(r) == 11 for r in rows)  # "256 x 384" is three
