"""scripts/soak_serve.py: its verdict, and a few seconds of it against the bundled model (the report's shape and
exit status; no timing or memory bound is meaningful that short, so they are set loose)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import soak_serve  # noqa: E402


def _row(t: float, rss: float, programs: int = 4) -> dict:
    return {"t_s": t, "rss_mib": rss, "compiled_programs": programs}


def test_verdict_names_each_problem():
    rows = [_row(0, 100.0), _row(10, 400.0), _row(20, 420.0), _row(30, 430.0)]
    clean = {"stream": {"ok": 5, "failed": 0, "errors": []}}
    kwargs = {"warmup_s": 10, "max_programs": 4, "rss_tolerance_mib": 50, "max_gap_s": 1.0, "tracebacks": 0,
              "server_exit": None}
    assert soak_serve.verdict(rows, [0.1, 0.9], clean, **kwargs) == []  # the warm-up's growth does not count
    assert soak_serve.verdict(rows + [_row(40, 451.0)], [], clean, **kwargs) == [
        "RSS grew 51.0 MiB from t=10 s (tolerance 50 MiB)"]
    assert soak_serve.verdict(rows, [0.2, 1.5], clean, **kwargs) == [
        "a chunk gap of 1.50 s after the warm-up (bound 1 s)"]
    failed = {"oversized": {"ok": 1, "failed": 2, "errors": ["HTTP 200, expected 413"]}}
    assert soak_serve.verdict(rows, [], failed, **kwargs) == [
        "oversized: 2 of 3 failed, e.g. HTTP 200, expected 413"]
    assert soak_serve.verdict(rows, [], clean, **{**kwargs, "tracebacks": 2, "server_exit": -9}) == [
        "2 tracebacks in the server's log", "the server exited during the soak (status -9)"]
    paced = [{**r, "gap_max_ms": 180.0, "step_max_ms": 75.0} for r in rows]
    assert soak_serve.verdict(paced, [], clean, **kwargs, gap_over_step_s=0.11) == []
    assert soak_serve.verdict(paced, [], clean, **kwargs, gap_over_step_s=0.1) == [
        f"a chunk gap of 180 ms up to t={t} s, whose longest step took at most 75 ms (bound: + 100 ms)"
        for t in (10, 20, 30)]


def test_the_longest_step_is_the_upper_edge_of_the_highest_bucket_that_gained_steps():
    before = {0.01: 5.0, 0.1: 7.0, float("inf"): 7.0}
    assert soak_serve.longest_step_s(before, {0.01: 9.0, 0.1: 12.0, float("inf"): 12.0}) == 0.1
    assert soak_serve.longest_step_s(before, {0.01: 9.0, 0.1: 11.0, float("inf"): 11.0}) == 0.01
    assert soak_serve.longest_step_s(before, {0.01: 5.0, 0.1: 7.0, float("inf"): 8.0}) == float("inf")
    assert soak_serve.longest_step_s(before, before) == 0.0


def test_the_rss_baseline_waits_for_the_program_cache_to_fill():
    """Each compiled program holds memory: until the server holds its --max-compiled-programs, growth is expected."""
    rows = [_row(0, 100.0, 1), _row(10, 200.0, 3), _row(20, 300.0, 4), _row(30, 310.0, 4)]
    assert soak_serve.baseline(rows, 5, 4) == 2
    assert soak_serve.baseline(rows, 25, 4) == 3
    assert soak_serve.baseline(rows, 5, 8) == 1  # never full: the first row after the warm-up
    assert soak_serve.baseline(rows, 40, 4) is None


@pytest.mark.slow  # ~25 s (a server start with warm-up, then every client kind): CI's budget
def test_a_few_seconds_of_soak_report_every_client_kind_and_pass(tmp_path):
    cmd = [sys.executable, str(SCRIPTS / "soak_serve.py"), "--minutes", "0.05", "--warmup-minutes", "0",
           "--server-log", str(tmp_path / "server.log"),
           "--sample-seconds", "1", "--max-tokens", "8", "--header-timeout", "0.5", "--json",
           "--server-args", "--block-size 64 --num-blocks 32 --max-num-seqs 8 --max-model-len 256",
           "--max-gap-seconds", "600", "--gap-over-step-seconds", "600", "--rss-tolerance-mib", "100000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "| t (s) | RSS MiB | compiled programs | compilations | requests ok / failed " \
           "| chunk gap ms p50 / p99 / max | longest step ms (at most) |" in lines
    report = json.loads(lines[-1])
    assert lines[-2] == "PASS" and report["problems"] == [] and report["tracebacks"] == 0
    assert len(report["rows"]) >= 2
    for row in report["rows"]:
        assert row["rss_mib"] > 100 and row["compiled_programs"] >= 0 and row["gap_p99_ms"] >= row["gap_p50_ms"]
        assert row["step_max_ms"] > 0  # steps ran in every sample
    assert report["rows"][-1]["compiled_programs"] >= 1
    assert set(report["clients"]) == set(soak_serve.KINDS)  # every kind of client ran, and got what it expected
    assert all(o["ok"] >= 1 and o["failed"] == 0 for o in report["clients"].values()), report["clients"]
    assert report["gaps_after_warmup"] > 0 and report["gap_max_ms"] >= report["gap_p99_ms"] > 0
    assert (tmp_path / "server.log").exists()
