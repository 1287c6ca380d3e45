"""Smoke tests: Tunix's GRPO with pagedjax's rollouts (scripts/grpo_tunix.py) and the rollout benchmark
(scripts/bench_rollout.py) run end to end, tiny (skipped without the [tunix] extra; slow: 11 s, each loads the
bundled model and compiles, where tests/integrations/test_tunix.py covers the same code)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("tunix")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_rollout  # noqa: E402
import grpo_tunix  # noqa: E402


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]


@pytest.mark.slow
def test_grpo_tunix_trains_two_steps_and_plots(capsys, tmp_path):
    plot = tmp_path / "grpo.png"
    grpo_tunix.main(["--steps", "2", "--prompts", "2", "--generations", "2", "--max-tokens", "4",
                     "--plot", str(plot)])
    table = rows(capsys.readouterr().out)
    assert [int(r[0]) for r in table] == [0, 1]
    assert all(0.0 <= float(r[1]) <= 1.0 and float(r[-1]) < 1e-4 for r in table)  # rewards; Tunix's trainer
    assert plot.stat().st_size > 0                                                 # vs the rollout's logprobs


@pytest.mark.slow
def test_bench_rollout_prints_its_table(capsys):
    bench_rollout.main(["--groups", "2", "--prompts", "1", "--max-tokens", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    engines = [" ".join(r[1:-4]) for r in rows(out)]
    assert engines == ["tunix vanilla", "pagedjax", "pagedjax batch-invariant"]
    assert "update_params (best of 1): pagedjax" in out
