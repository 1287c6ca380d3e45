"""scripts/bench_kv_bytes.py: the engine's block accounting for one long request per model agrees with the specs'
bytes (asserted inside), and DeepSeek V4's compressed attention keeps far less KV per token than V3.2 and GQA-8."""

from __future__ import annotations

from tests.scripts_module import load_script


def test_bench_kv_bytes_quick(monkeypatch):
    rows = load_script("bench_kv_bytes", monkeypatch).main(["--quick"])
    per_token = {row.split("|")[1].strip(): float(row.split("|")[3].split()[0]) for row in rows[2:]}
    assert per_token["DeepSeek V4-Flash"] * 10 < per_token["DeepSeek V3.2"] < per_token["GQA-8 (64 layers)"]
