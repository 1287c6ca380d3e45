"""One engine over two processes (`jax.distributed` on this machine: CPU, gloo over loopback, 2 devices each, tp 4
across both): process 0 leads (`MultiHostEngine`), process 1 follows (`follow`); `tests/parallel/multihost_worker.py`
is each process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(tmp_path: Path, case: str) -> tuple[list[dict], list[subprocess.CompletedProcess]]:
    """Both processes of `case`; their results and exits."""
    port = free_port()
    # The suite's XLA flags go on (at XLA's default level both processes took 3x the time); the worker adds its
    # device count.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # its engine runs without the persistent cache (tests/conftest.py)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_worker", str(rank), str(port),
                               str(tmp_path / f"{rank}.json"), case], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    results = [json.loads(f.read_text()) if (f := tmp_path / f"{rank}.json").is_file() else None for rank in (0, 1)]
    return results, done


# (CI time: ~30 s of CPU in two processes) CI's two-process check is tests/serve/test_serve_multihost.py (the same
# leader and follower behind pagedjax-serve: greedy text equal to one process's, a follower killed mid-stream); this
# one adds the dense reference through preemption, prefix hits, an abort mid-way and a message past one frame.
@pytest.mark.slow
def test_one_leader_one_follower_give_the_dense_tokens(tmp_path):
    """Only process 0 is given requests; both step together: the dense model's greedy tokens (prefix cache,
    preemption, chunked prefill and fused decode on), requests added while others run and one aborted mid-way
    (the follower applies each between the same steps, or the state digests would differ), a message longer than one
    frame, and a clean close."""
    (lead, follow), procs = run_pair(tmp_path, "serve")
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(p.stderr[-3000:] for p in procs)
    assert lead["tokens"] == lead["reference"]
    assert lead["preemptions"] > 0
    assert lead["aborted"] and "x" not in lead["late"]
    assert lead["late"]["y"] == lead["reference"][2]
    assert lead["exchanges"] > 4 and lead["bytes"] > 8192  # one exchange past a frame
    assert follow == {"followed": True}


# (CI time: ~10 s of two processes) the processes compare their descriptions in every check here (their start-up);
# a mismatch's message and its refusal by both command lines: tests/engine/test_multihost_leader.py; a lost
# follower through the server, mid-stream: tests/serve/test_serve_multihost.py.
@pytest.mark.slow
def test_a_lost_follower_fails_the_leaders_step_at_once(tmp_path):
    """Process 1 dies mid-run: process 0's step raises RankLostError within seconds, and so does every later call."""
    (lead, follow), procs = run_pair(tmp_path, "lost")
    assert procs[1].returncode == 3 and follow is None
    assert procs[0].returncode == 0, procs[0].stderr[-3000:]
    assert "a process was lost" in lead["error"] and lead["seconds"] < 20
    assert "a process was lost" in lead["later"]  # every later call raises it too
