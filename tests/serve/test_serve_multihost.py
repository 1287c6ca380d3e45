"""`pagedjax-serve` over two processes (`--nnodes 2`, tp 2 across them: one CPU device each, gloo over loopback):
process 0 serves HTTP, process 1 follows. Greedy completions equal one process's engine; a follower killed while a
stream runs ends that stream with an error event, and process 0 exits 2 at once, naming the lost process. (Also
where the server's INFO lines are checked: one more server process cost 5 s of CI time.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from pagedjax import LLMEngine, SamplingParams
from pagedjax.serve.cli import BUNDLED_MODEL_NAME
from tests.serve.test_serve_cli import _free_port, _wait_healthy

ENGINE_FLAGS = ["--block-size", "64", "--num-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--max-model-len", "4096", "--no-warmup", "--tensor-parallel-size", "2"]


def _start(rank: int, port: int, coordinator: int) -> subprocess.Popen:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "pagedjax.serve", "--port", str(port), "--nnodes", "2", "--node-rank", str(rank),
           "--dist-init-addr", f"127.0.0.1:{coordinator}", "--no-compile-cache", *ENGINE_FLAGS,
           "--log-level", "info" if rank == 0 else "warning"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_one_endpoint_over_two_processes_and_a_lost_follower():
    port, coordinator = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [_start(rank, port, coordinator) for rank in (0, 1)]
    try:
        _wait_healthy(procs[0], url)
        prompt = "def main():\n"
        body = {"model": BUNDLED_MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        one = LLMEngine.from_pretrained()  # (the suite's compile cache: other tests' programs of the model)
        assert got == one.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text

        events, killed = [], None
        stream = {**body, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=stream, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if killed is None:
                        procs[1].send_signal(signal.SIGKILL)
                        killed = time.monotonic()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "unavailable" and "a process was lost" in error["message"], error
        assert procs[0].wait(timeout=30) == 2
        assert time.monotonic() - killed < 30
        out = procs[0].stdout.read()
        assert "pagedjax-serve: error: a process was lost" in out, out
        # The server's INFO lines show, once: importing orbax gives the root logger a handler before `main()` runs
        # (it logs through the root logger), which made the server's own `logging.basicConfig` do nothing.
        assert out.count(f"INFO pagedjax.serve.app: serving {BUNDLED_MODEL_NAME} ") == 1, out
        assert "INFO pagedjax.engine.llm_engine: LLMEngine: " in out, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
