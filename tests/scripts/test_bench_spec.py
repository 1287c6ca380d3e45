"""Smoke tests: the speculative decoding benchmarks run end to end on the tiny model (no timing assertions)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_spec  # noqa: E402
import bench_verify  # noqa: E402


@pytest.mark.slow  # (CI time) compiles six engines and four drafts
def test_bench_spec_draft_rows(capsys):
    bench_spec.main(["--model", "tiny", "--quick", "--workload", "draft", "--batch", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("draft ", "oracle"))]
    assert [r[:2] for r in rows] == [["draft", "small"], ["draft", "2"], ["draft", "="], ["oracle", "k=4"],
                                     ["oracle", "k=4,"]]  # the last one's verifying steps padded to 2^n
    assert all(r[-1] == "True" for r in rows)  # every row's tokens are the plain run's
    assert rows[2][-2] == rows[3][-2] == rows[4][-2] == "100%"  # the target as its own draft, the oracles: all


@pytest.mark.slow  # (CI time) compiles seven step programs
def test_bench_verify_runs(capsys):
    bench_verify.main(["--model", "tiny", "--calls", "1", "--repeats", "1"])
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.startswith(("decode", "verify"))]
    assert len(rows) == 7 and rows[0][-2] == "1.00x"
    assert [r[5:7] for r in rows if r[:3] == ["verify", "k=4", "(as"]] == [["5", "1"]]  # 5 tokens of 1 sequence
    linears = [line.split() for line in out[out.index(next(x for x in out if "the linears alone" in x)) + 1:]]
    assert [r[0] for r in linears] == ["1", "5", "8"] and linears[0][2] == "1.00x"
