"""The several-hosts flags of both command lines (`pagedjax.cli.multihost.start`): what does not fit together is a
one-line error before JAX starts. Two processes: tests/parallel/test_multihost.py,
tests/serve/test_serve_multihost.py."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time

import pytest

from pagedjax.cli import multihost
from pagedjax.cli.args import build_parser as generate_parser
from pagedjax.cli.errors import CLIError
from pagedjax.serve.cli import build_parser as serve_parser


@pytest.mark.parametrize("parser", [generate_parser, serve_parser])
@pytest.mark.parametrize("argv, error", [
    (["--nnodes", "2"], "--nnodes / --node-rank need --dist-init-addr"),
    (["--node-rank", "1"], "--nnodes / --node-rank need --dist-init-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank 2 must be below --nnodes 2"),
    (["--nnodes", "2", "--dist-init-addr", "host0"], "must be HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "host0:70000"], r"must be HOST:PORT \(a port 1-65535\)"),
    (["--nnodes", "2", "--dist-init-addr", "auto"], "leave out --nnodes and --node-rank"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--data-parallel-size", "2"], "replicas across hosts"),
])
def test_flags_that_do_not_fit_are_named(parser, argv, error):
    with pytest.raises(CLIError, match=error):
        multihost.start(parser().parse_args(argv))


@pytest.mark.parametrize("parser", [generate_parser, serve_parser])
def test_a_follower_that_cannot_reach_process_0_says_so_within_the_join_timeout(parser):
    """Process 1 given an address where nothing listens: a one-line error naming it after --dist-join-timeout, before
    JAX is asked to join (its own wait ends the process with an abort)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    args = parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}",
                                "--dist-join-timeout", "1"])
    start = time.monotonic()
    with pytest.raises(CLIError, match=rf"process 0's coordinator at 127.0.0.1:{port} did not answer within 1 s "
                                       r"\(.+\): is process 0 started"):
        multihost.start(args)
    assert time.monotonic() - start < 10
    assert "dist_join_timeout" not in multihost.description(args)["flags"]


def test_one_process_is_the_default_and_the_description_leaves_out_per_process_flags(tmp_path):
    args = serve_parser().parse_args(["--api-key", "secret", "--port", "9001", "--max-num-seqs", "4"])
    assert multihost.start(args) is None and args.processes == 1
    described = multihost.description(args)
    assert "api_key" not in described["flags"] and "port" not in described["flags"]
    assert "node_rank" not in described["flags"] and described["flags"]["max_num_seqs"] == "4"
    (tmp_path / "config.json").write_text("{}")
    folder = generate_parser().parse_args(["--model", str(tmp_path)])
    assert multihost.description(folder)["model_files"] == {"config.json": 2}
    with pytest.raises(SystemExit):
        generate_parser().parse_args(["--dist-timeout", "0"])


# Variables by which JAX's `jax.distributed.initialize()` detects a cluster (jax._src.clusters).
_CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "PMI_", "KUBERNETES_SERVICE_HOST", "TPU_", "MEGASCALE_")


def _no_cluster_env(**extra) -> dict:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_VARIABLES)}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags), **extra)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def test_auto_outside_a_cluster_is_a_one_line_error():
    """`--dist-init-addr auto` where JAX detects no cluster: exit 2 and what to give instead (not JAX's traceback)."""
    run = subprocess.run([sys.executable, "-m", "pagedjax.cli", "--dist-init-addr", "auto", "--prompt", "hi"],
                         capture_output=True, text=True, env=_no_cluster_env(), timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedjax-generate: error: --dist-init-addr auto found no cluster (SLURM, Open MPI, "
                           "Cloud TPU, GKE): "), run.stderr
    assert "Give --dist-init-addr HOST:PORT with --nnodes and --node-rank" in run.stderr


def _slurm_port() -> int:
    """A free port in the range JAX's SLURM detection puts process 0's coordinator in (61440 + job id % 4096)."""
    for port in random.Random(os.getpid()).sample(range(61440, 65536), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 61440-65535")


@pytest.mark.slow  # (CI time: two processes; CI's two-process check is tests/serve/test_serve_multihost.py)
def test_auto_under_slurm_runs_the_same_command_on_every_task():
    """Two tasks of a (simulated) SLURM job step on this host, each `pagedjax-generate --dist-init-addr auto
    --tensor-parallel-size 2` with only SLURM's variables telling them apart: JAX finds process 0's address, the
    count and each index; process 0 prints the greedy completion of one process's engine, process 1 prints none."""
    port = _slurm_port()
    slurm = dict(SLURM_JOB_ID=str(port - 61440), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_LOCALID="0")
    cmd = [sys.executable, "-m", "pagedjax.cli", "--dist-init-addr", "auto", "--tensor-parallel-size", "2",
           "--prompt", "def main():", "--max-tokens", "12", "--temperature", "0", "--no-warmup", "--no-compile-cache"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_no_cluster_env(**slurm, SLURM_PROCID=str(rank))) for rank in (0, 1)]
    try:
        done = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in done]
    from pagedjax import LLMEngine, SamplingParams

    text = LLMEngine.from_pretrained().generate("def main():", SamplingParams(max_tokens=12, temperature=0))[0].text
    assert "def main():" + text in done[0][0], done[0][0]
    # (gloo itself prints "[Gloo] Rank i is connected ..." to standard output)
    printed = ["".join(line for line in out.splitlines(True) if not line.startswith("[Gloo]")) for out, _ in done]
    assert "tensor parallel 2 x data parallel 1" in printed[0] and printed[1] == "", printed
