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


def test_verdict_holds_the_second_half_and_the_probes_to_their_bounds():
    """Issue 63: RSS that keeps rising after the warm-up, each server's own; and a probe stream's p99 chunk gap
    within its server's mean step + the margin."""
    kwargs = {"warmup_s": 0, "max_programs": 4, "rss_tolerance_mib": 1e6, "max_gap_s": 1e6, "tracebacks": 0,
              "server_exit": None, "gap_over_step_s": 0.1, "last_half_growth_percent": 5.0}
    rows = [{**_row(t, 1000.0 + t), "vision_rss_mib": rss, "vision_compiled_programs": 4}
            for t, rss in zip((0, 100, 200, 300, 400), (500.0, 600.0, 520.0, 530.0, 540.0), strict=True)]
    # the bundled model's server: 1200 -> 1400 over the second half (+16.7%); the vision server's: its least 520
    # (a burst at t=100 s is not where growth is measured from) -> 540 (+3.8%)
    assert soak_serve.last_half_growth(rows) == (200.0, 100 * 200 / 1200)
    assert soak_serve.last_half_growth(rows, "vision_") == (20.0, 100 * 20 / 520)
    assert soak_serve.verdict(rows, [], {}, **kwargs, vision=True) == [
        "RSS grew 200.0 MiB (16.7%) over the second half (bound 5%)"]
    flat = [{**r, "rss_mib": 1000.0} for r in rows]
    assert soak_serve.verdict(flat, [], {}, **kwargs, vision=True, vision_exit=1) == [
        "the vision server exited during the soak (status 1)"]
    assert soak_serve.verdict([{**r, "vision_rss_mib": 500.0 + r["t_s"]} for r in flat], [], {}, **kwargs,
                              vision=True) == ["the vision server's RSS grew 200.0 MiB (28.6%) over the second half "
                                               "(bound 5%)"]
    probes = {"text": ([0.05] * 99 + [0.3], 0.05), "vision": ([0.01] * 200, 0.02)}
    assert soak_serve.verdict(flat, [], {}, **kwargs, probes=probes) == []
    probes["text"] = ([0.05] * 90 + [0.3] * 10, 0.05)
    assert soak_serve.verdict(flat, [], {}, **kwargs, probes=probes) == [
        "the text probe's p99 chunk gap is 300 ms, its server's mean step 50 ms (bound: + 100 ms)"]


def test_the_mean_step_counts_the_steps_after_the_warm_up():
    rows = [{"t_s": 0, "steps": 10.0, "steps_s": 5.0}, {"t_s": 10, "steps": 20.0, "steps_s": 6.0},
            {"t_s": 20, "steps": 120.0, "steps_s": 8.0}]
    assert soak_serve.mean_step_s(rows, 5) == pytest.approx(3 / 110)  # 3 s over 110 steps, from the last row before
    assert soak_serve.mean_step_s(rows, 0) == pytest.approx(8.0 / 120)
    assert soak_serve.mean_step_s(rows, 30) is None
    assert soak_serve.mean_step_s(rows, 5, "vision_") is None


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


@pytest.mark.slow  # ~50 s (two servers' starts with warm-up, then every client kind): CI's budget
def test_a_few_seconds_of_soak_report_every_client_kind_and_pass(tmp_path):
    cmd = [sys.executable, str(SCRIPTS / "soak_serve.py"), "--minutes", "0.05", "--warmup-minutes", "0",
           "--server-log", str(tmp_path / "server.log"),
           "--sample-seconds", "1", "--max-tokens", "8", "--header-timeout", "0.5", "--json",
           "--server-args", "--block-size 64 --num-blocks 32 --max-num-seqs 8 --max-model-len 256",
           "--max-gap-seconds", "600", "--gap-over-step-seconds", "600", "--rss-tolerance-mib", "100000",
           "--last-half-growth-percent", "100000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert soak_serve.COLUMNS in lines
    report = json.loads(lines[-1])
    assert lines[-2] == "PASS" and report["problems"] == [] and report["tracebacks"] == 0
    assert len(report["rows"]) >= 2
    for row in report["rows"]:
        assert row["rss_mib"] > 100 and row["compiled_programs"] >= 0 and row["gap_p99_ms"] >= row["gap_p50_ms"]
        assert row["vision_rss_mib"] > 100  # the LLaVA server's, for the image clients
    # both servers ran steps (not in every 1-second sample: one step can outlast it on a loaded machine, and the
    # last samples wait for the image bombs' requests alone)
    assert any(row["step_max_ms"] > 0 for row in report["rows"])
    assert report["rows"][-1]["steps"] > 0 and report["rows"][-1]["vision_steps"] > 0
    assert report["rows"][-1]["compiled_programs"] >= 1
    assert set(report["clients"]) == set(soak_serve.KINDS)  # every kind of client ran, and got what it expected
    assert all(o["ok"] >= 1 and o["failed"] == 0 for o in report["clients"].values()), report["clients"]
    assert report["gaps_after_warmup"] > 0 and report["gap_max_ms"] >= report["gap_p99_ms"] > 0
    assert (tmp_path / "server.log").exists() and (tmp_path / "vision_server.log").exists()
    assert set(report["probes"]) == {"text", "vision"} and all(p["gaps"] > 0 for p in report["probes"].values())



def test_three_of_the_image_clients_largest_pictures_fit_the_vision_servers_default_body_limit():
    """The image client sends 1-3 random pictures: three of the largest (noise as PNG, which does not compress) in
    one chat stay under pagedjax-serve's default --max-request-bytes, so the client never meets a 413 it does not
    expect; and the client's pictures decode at the sizes drawn."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from pagedjax.serve.app import DEFAULT_MAX_REQUEST_BYTES

    side = soak_serve.IMAGE_SIDES[1]
    noise = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    url = soak_serve.image_data_url(noise, "PNG")
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this ?"}] + [
        {"type": "image_url", "image_url": {"url": url}}] * 3}], "max_tokens": 8}
    assert len(json.dumps(body).encode()) < DEFAULT_MAX_REQUEST_BYTES
    for seed in range(6):
        url = soak_serve.random_image_url(seed)
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert all(soak_serve.IMAGE_SIDES[0] <= n <= side for n in image.size)
        assert url.startswith(f"data:image/{image.format.lower()};base64,")
