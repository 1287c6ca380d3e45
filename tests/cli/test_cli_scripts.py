"""scripts/run.sh and scripts/test.sh, run against stub tools in a copy of the repository's layout (no pip,
no JAX: each run takes milliseconds)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def _repo(tmp_path: Path, script: str) -> tuple[Path, Path]:
    """(a repo root holding scripts/<script> and pyproject.toml, the log the stubs write to)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, root / "scripts" / script)
    (root / "pyproject.toml").write_text('[project]\nname = "pagedjax"\nversion = "0.1.0"\n')
    return root, tmp_path / "log"


def _log(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_run_sh_installs_only_when_the_project_changed(tmp_path):
    root, log = _repo(tmp_path, "run.sh")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    # pip "installs" the console script, as `pip install -e .` does.
    _stub(bin_dir / "pip", f'echo "pip $*" >> {log}\n'
                           f'printf \'#!/bin/sh\\necho "generate $*" >> {log}\\n\' > {bin_dir}/pagedjax-generate\n'
                           f'chmod +x {bin_dir}/pagedjax-generate')

    def run(*args: str) -> list[str]:
        before = len(_log(log))
        r = subprocess.run(["bash", str(root / "scripts" / "run.sh"), *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        calls = _log(log)[before:]
        # An install says so first (pip -q is silent for the minute it takes; run.sh used to print nothing).
        assert ("installing pagedjax and its dependencies into .venv (about a minute" in r.stderr) == \
            calls[0].startswith("pip"), r.stderr
        return calls

    assert run() == ["pip install -q -e .", "generate --demo"]  # a fresh checkout installs
    assert run("--prompt", "x") == ["generate --prompt x"]  # nothing changed: no pip
    assert run() == ["generate --demo"]
    with open(root / "pyproject.toml", "a") as f:
        f.write('dependencies = ["numpy"]\n')
    assert run() == ["pip install -q -e .", "generate --demo"]  # the project changed
    assert run() == ["generate --demo"]
    (bin_dir / "pagedjax-generate").unlink()
    assert run() == ["pip install -q -e .", "generate --demo"]  # the console script went missing


# What a stub pip answers to `pip config list`: two files' settings and the variables', as pip lists them.
PIP_CONFIG = (":env:.find-links='/wheels'\n"
              ":env:.index-url='https://mirror.example/simple'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\n"
              "global.find-links='/wheels'\n"
              "global.index-url='https://files.example/simple'\n"
              "install.constraint='/etc/constraints.txt'\n"
              "global.cert='/etc/ssl/cert.pem'")
UV_SOURCES = ("--find-links /wheels --extra-index-url file:///a/simple --extra-index-url file:///b/simple "
              "--constraint /etc/constraints.txt --default-index https://mirror.example/simple")


def _pip_stub(venv: Path, log: Path, installs_uv: bool = True, uv_fails: bool = False) -> None:
    """A pip that lists PIP_CONFIG, logs its installs, and installs uv (a stub logging its calls, and failing with
    `uv_fails`) or cannot."""
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "config-listing").write_text(PIP_CONFIG + "\n")
    uv = venv / "bin" / "uv"
    uv_exit = "\\necho no solution found >\\&2\\nexit 1" if uv_fails else ""
    get_uv = (f'printf \'#!/bin/sh\\necho "{venv.name} uv $*" >> {log}{uv_exit}\\n\' > {uv}; chmod +x {uv}'
              if installs_uv else 'echo "no matching distribution for uv" >&2; exit 1')
    _stub(venv / "bin" / "pip", f'case "$*" in\n'
                                f'  "config list") cat {venv}/config-listing ;;\n'
                                f'  *" uv") {get_uv} ;;\n'
                                f'  *) echo "{venv.name} pip $*" >> {log} ;;\n'
                                f'esac')


def test_test_sh_reports_the_slowest_tests(tmp_path):
    root, log = _repo(tmp_path, "test.sh")
    for venv in (".venv", ".venv312"):
        bytecode = f'echo "bytecode ${{PYTHONDONTWRITEBYTECODE:-written}}" >> {log}'
        _stub(root / venv / "bin" / "python", f'echo "{venv} python $*" >> {log}\n{bytecode}\necho stub')
        _pip_stub(root / venv, log)
    for name, text in (("marked", "@pytest.mark.xla_default\ndef test_a(): pass\n"), ("plain", "def test_b(): pass\n")):
        (root / "tests" / "model").mkdir(parents=True, exist_ok=True)
        (root / "tests" / "model" / f"test_{name}.py").write_text(text)
    path_dir = tmp_path / "path"
    _stub(path_dir / "python3.12", "true")
    env = dict(os.environ, PATH=f"{path_dir}{os.pathsep}{os.environ['PATH']}", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run(["bash", str(root / "scripts" / "test.sh"), "-k", "block_pool"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    # modules are compiled once, into __pycache__, even where the CI image asks Python not to write bytecode
    assert {line for line in _log(log) if line.startswith("bytecode ")} == {"bytecode written"}
    pytest_runs = [line for line in _log(log) if " -m pytest " in line]
    assert len(pytest_runs) == 3, _log(log)
    suites, default_level = [r for r in pytest_runs if "xla_default" not in r], \
        [r for r in pytest_runs if "xla_default" in r]
    assert [r.split()[0] for r in suites] == [".venv", ".venv312"], pytest_runs  # both Pythons
    assert all("--durations=15" in line for line in suites), pytest_runs
    assert suites[0].endswith("-k block_pool")
    # the -O default run collects only the files that hold its tests
    assert default_level == [".venv python -m pytest -q -m xla_default tests/model/test_marked.py"], default_level
    # both environments install by uv, from pip's package sources
    installs = sorted(line for line in _log(log) if " uv " in line or " pip " in line)
    assert installs == [
        f".venv uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match {UV_SOURCES} "
        "torch==2.13.0 -e .[test,hf]",
        ".venv312 uv pip install -q --python .venv312/bin/python --index-strategy unsafe-best-match "
        f"{UV_SOURCES} --upgrade jax jaxlib flax -e .[test]"], installs


@pytest.mark.parametrize("uv", ["cannot be had", "cannot install"])
def test_test_sh_installs_by_pip_where_uv_cannot(tmp_path, uv):
    root, log = _repo(tmp_path, "test.sh")
    for venv in (".venv", ".venv312"):
        _stub(root / venv / "bin" / "python", f'echo "{venv} python $*" >> {log}\necho stub')
        _pip_stub(root / venv, log, installs_uv=uv == "cannot install", uv_fails=True)
    path_dir = tmp_path / "path"
    _stub(path_dir / "python3.12", "true")
    env = dict(os.environ, PATH=f"{path_dir}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", str(root / "scripts" / "test.sh")], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    said = "could not install into" if uv == "cannot install" else "could not be installed into"
    for venv in (".venv", ".venv312"):
        assert f"uv {said} {venv}: pip installs instead" in r.stderr
    pip_installs = sorted(line for line in _log(log) if " pip install" in line and " uv " not in line)
    assert pip_installs == [".venv pip install -q --no-compile torch==2.13.0 -e .[test,hf]",
                            ".venv312 pip install -q --no-compile --upgrade jax jaxlib flax -e .[test]"], pip_installs
    assert len([line for line in _log(log) if " uv pip install " in line]) == (2 if uv == "cannot install" else 0)
    assert len([line for line in _log(log) if " -m pytest " in line]) == 3


def test_test_sh_fails_with_the_log_when_the_newest_jax_environment_cannot_be_set_up(tmp_path):
    """A second environment that cannot be set up (it installs beside the first) fails the script with pip's
    output before any test runs."""
    root, log = _repo(tmp_path, "test.sh")
    for venv in (".venv", ".venv312"):
        _stub(root / venv / "bin" / "python", f'echo "{venv} python $*" >> {log}\necho stub')
    _pip_stub(root / ".venv", log)
    # neither uv nor jaxlib can be had there
    _stub(root / ".venv312" / "bin" / "pip", 'echo "no matching distribution for jaxlib" >&2; exit 1')
    path_dir = tmp_path / "path"
    _stub(path_dir / "python3.12", "true")
    env = dict(os.environ, PATH=f"{path_dir}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", str(root / "scripts" / "test.sh")], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode != 0
    assert "no matching distribution for jaxlib" in r.stderr and "no test ran" in r.stderr
    assert [line for line in _log(log) if " -m pytest " in line] == []
