"""Smoke test: the RL example runs end to end (slow: it loads the bundled model and compiles a trainer)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import rl_tiny  # noqa: E402


@pytest.mark.slow
def test_rl_tiny_runs_and_a_fresh_engine_draws_the_same_rollouts(capsys, tmp_path):
    plot = tmp_path / "curve.png"
    rl_tiny.main(["--steps", "2", "--prompts", "2", "--n", "2", "--max-tokens", "4", "--compare", "1",
                  "--plot", str(plot)])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1]
    assert rows[1][4] == "True"  # the fresh engine with the updated weights drew the same samples
    assert all(float(r[-4]) < 1e-4 for r in rows)  # rollout vs the dense forward's log-probabilities
    assert all(float(r[-3]) == 0.0 for r in rows)  # the trainer's (exact) ones: an importance ratio of exactly 1
    assert plot.stat().st_size > 0


def test_by_default_it_writes_nothing_and_a_plot_without_matplotlib_fails_before_the_work(monkeypatch, capsys):
    """It used to do all its work and then exit 1 on a missing matplotlib, after writing nothing; and by default
    it wrote a PNG into the current folder."""
    called = []
    monkeypatch.setattr(rl_tiny, "load_pretrained", lambda *a, **k: called.append(a) or (_ for _ in ()).throw(
        RuntimeError("the work started")))
    with pytest.raises(RuntimeError, match="the work started"):
        rl_tiny.main([])  # no --plot: straight to the work, nothing to write
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exit_info:
        rl_tiny.main(["--plot", "out/curve.png"])
    assert exit_info.value.code == 2 and len(called) == 1
    assert "--plot needs matplotlib" in capsys.readouterr().err
