"""Smoke test: the quantization benchmark runs end to end on a tiny workload (no timing assertions)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_quant  # noqa: E402


@pytest.mark.slow  # compiles three engines and three dense forwards: a minute on a shared CI machine
def test_bench_quant_quick_runs(capsys):
    bench_quant.main(["--quick"])
    out = capsys.readouterr().out
    speed = [line.split() for line in out.splitlines() if line.startswith(("float32 ", "int8 ", "int4 "))]
    assert [r[0] for r in speed] == ["float32"] * 2 + ["int8"] * 2 + ["int4"] * 2 + ["float32", "int8", "int4"]
    agreement = {r[0]: float(r[1]) for r in speed[6:]}
    assert agreement["float32"] == 1.0 and 0.5 < agreement["int4"] <= agreement["int8"] <= 1.0


def test_scheme_names():
    assert bench_quant.quant_config("float32") is None
    assert bench_quant.quant_config("int4:32-head").keep_float == ()
    assert bench_quant.quant_config("int4:32").group_size == 32


def test_llama_rows_need_both_the_python_and_the_sources(capsys):
    with pytest.raises(SystemExit):
        bench_quant.main(["--llama-python", sys.executable])
    assert "--llama-python and --llama-cpp-dir go together" in capsys.readouterr().err


@pytest.mark.slow  # (CI time) compiles seven small programs
def test_bench_quant_matvec_quick_runs(capsys):
    import bench_quant_matvec

    bench_quant_matvec.main(["--quick"])  # checks every formulation against the dequantized product first
    rows = [line.split("]", 1)[1].rsplit(None, 3)[0].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("[256 -> 64]")]
    assert rows == ["float32", "int8", "int4", "int4 two shifts", "int4 jnp.int4", "int4 group sums", "int4 no scales"]
