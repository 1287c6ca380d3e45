"""scripts/bench_serving.py's parts on a tiny workload against the tests' server (no timing assertions): the
workload's lengths, the client's accounting, the summary's statistics."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedjax.model.tokenizer import ByteTokenizer
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_serving  # noqa: E402


def test_workload_lengths_are_exact_and_fit():
    requests = bench_serving.make_workload(ByteTokenizer(), num_prompts=50, prompt_median=40, output_median=20,
                                           max_model_len=MAX_MODEL_LEN, seed=1)
    again = bench_serving.make_workload(ByteTokenizer(), num_prompts=50, prompt_median=40, output_median=20,
                                        max_model_len=MAX_MODEL_LEN, seed=1)
    assert [(r.prompt_ids, r.output_len) for r in requests] == [(r.prompt_ids, r.output_len) for r in again]
    assert all(4 <= len(r.prompt_ids) and len(r.prompt_ids) + r.output_len <= MAX_MODEL_LEN for r in requests)
    assert len({len(r.prompt_ids) for r in requests}) > 10  # a spread, not one length


def test_summary_statistics():
    results = [bench_serving.Result(ok=True, start=0.0, ttft=0.1 * i, latency=0.1 * i + 1.0, output_tokens=11,
                                    chunk_times=[0.1 * i + 0.1 * k for k in range(11)]) for i in range(1, 5)]
    results.append(bench_serving.Result(ok=False, error="HTTP 503"))
    s = bench_serving.summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, ["HTTP 503"])
    assert s["req_per_s"] == 2.0 and s["out_tok_per_s"] == 22.0
    assert s["ttft_ms"][0] == pytest.approx(250.0) and s["ttft_ms"][1] == pytest.approx(250.0)
    assert s["tpot_ms"] == pytest.approx((100.0, 100.0, 100.0))
    assert s["itl_ms"] == pytest.approx((100.0, 100.0, 100.0))


def test_run_against_a_server():
    requests = bench_serving.make_workload(ByteTokenizer(), num_prompts=6, prompt_median=20, output_median=8,
                                           max_model_len=MAX_MODEL_LEN, seed=0)
    with running_server(make_engine()) as server:
        for rate in (math.inf, 50.0):
            results, duration = asyncio.run(bench_serving.run_rate(server.url, MODEL_NAME, requests, rate, seed=0))
            assert [r.error for r in results] == [""] * len(requests)
            assert [r.output_tokens for r in results] == [r.output_len for r in requests]
            assert all(0 < r.ttft <= r.latency <= duration for r in results)
            assert all(np.all(np.diff(r.chunk_times) >= 0) for r in results)
        assert bench_serving.compilations(server.url) >= 1
