"""Smoke test of scripts/bench_images.py --quick (no timing assertions: the numbers are this machine's; what is
asserted is what the rows count: placeholders, cached tokens, whether the encoder ran)."""


import pytest

from tests.scripts_module import load_script


@pytest.mark.slow  # (CI time) a script's smoke run: the image engine's paths run in tests/engine/test_images_engine.py
def test_bench_images_quick(capsys, monkeypatch):
    bench = load_script("bench_images", monkeypatch)
    result = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "| images | prompt tokens | TTFT ms |" in out and "| same image again |" in out
    ttft = result["ttft"]
    # 16 text tokens, then per image 16 placeholders (a 32 px image in 8 px patches) and 3 text tokens
    assert [ttft[n]["prompt_tokens"] for n in (0, 1, 4)] == [16, 35, 92]
    assert ttft[0]["encoder_s"] == 0 < ttft[1]["encoder_s"]
    new, same = result["prefix"]["new image"], result["prefix"]["same image again"]
    assert same["encoder_s"] == 0 < new["encoder_s"]  # a cached image is not encoded again
    assert new["cached_tokens"] == 16 and same["cached_tokens"] == 32  # blocks of 16: up to the image, or all
