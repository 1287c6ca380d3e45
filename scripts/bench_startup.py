"""pagedjax-serve's start-up: seconds from launching the server to `/health` answering 200 and to its first
completion's response, with an empty compilation cache (cold) and with the one a cold start filled (warm).

    python scripts/bench_startup.py                              # the bundled model, the server's defaults
    python scripts/bench_startup.py --runs 5 --server-args "--no-warmup"

Each run starts `python -m pagedjax.serve` on a free port with a compilation cache of its own (`--compile-cache`:
a fresh folder for a cold run; the first cold run's folder, filled, for a warm one), polls `/health` every 20 ms
and then sends one completion (a short prompt, 8 tokens, greedy): the first request a client sends once the server
says it is healthy. The server's CPU time by its first response and the 1-minute load average are read as each run
ends: on a shared machine the wall times stretch with the load, and mean little without it. The table and the
medians go to stdout; the servers' logs to `--log-dir`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = {"model": "pagedjax-tiny", "prompt": "def fib(n):\n", "max_tokens": 8, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(cache: Path, server_args: list[str], log: Path, timeout: float = 600) -> dict:
    """Start a server with compilation cache `cache`; seconds to /health 200 and to the first response."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedjax.serve", "--port", str(port), "--compile-cache", str(cache),
               "--log-level", "info", *server_args]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = start + timeout
        with httpx.Client(timeout=timeout) as client:
            while True:
                if proc.poll() is not None or time.perf_counter() > deadline:
                    raise SystemExit(f"the server exited ({proc.returncode}) or never answered; its log: {log}")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            healthy = time.perf_counter() - start
            response = client.post(f"{url}/v1/completions", json={**PROMPT, "model": model_name(server_args)})
            first = time.perf_counter() - start
            cpu = cpu_seconds(proc.pid)
            if response.status_code != 200:
                raise SystemExit(f"the first completion answered {response.status_code}: {response.text[:500]}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"health_s": healthy, "first_response_s": first, "cpu_s": cpu, "load_1m": os.getloadavg()[0]}


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, every thread) process `pid` has used (Linux's /proc; None elsewhere): on a
    loaded machine the wall times stretch with the load, this does not."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def model_name(server_args: list[str]) -> str:
    """The model id the server answers to (`--served-model-name`, else the bundled model's)."""
    if "--served-model-name" in server_args:
        return server_args[server_args.index("--served-model-name") + 1]
    if "--model" in server_args:
        return server_args[server_args.index("--model") + 1]
    return PROMPT["model"]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="cold starts, and as many warm ones")
    p.add_argument("--server-args", default="", help="more pagedjax-serve arguments, as one string")
    p.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (default: a temporary folder)")
    args = p.parse_args(argv)
    server_args = shlex.split(args.server_args)
    with tempfile.TemporaryDirectory(prefix="pagedjax-startup-") as tmp:
        logs = args.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(args.runs):  # every cold run compiles into a fresh folder; the first one's is kept
            rows.append({"cache": "cold", **one_start(Path(tmp) / f"cold{i}", server_args, logs / f"cold{i}.log")})
        for i in range(args.runs):
            rows.append({"cache": "warm", **one_start(Path(tmp) / "cold0", server_args, logs / f"warm{i}.log")})
    print(f"pagedjax-serve start-up ({shlex.join(server_args) or 'the defaults'}), {os.cpu_count()} CPUs")
    print("| run | compile cache | /health 200 (s) | first response (s) | server CPU time by then (s) | load average "
          "(1 min) |")
    print("|---:|---|---:|---:|---:|---:|")
    for i, r in enumerate(rows):
        cpu = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.1f}"
        print(f"| {i + 1} | {r['cache']} | {r['health_s']:.1f} | {r['first_response_s']:.1f} | {cpu} | "
              f"{r['load_1m']:.1f} |")
    for cache in ("cold", "warm"):
        sel = [r for r in rows if r["cache"] == cache]
        print(f"{cache}: median first response {statistics.median(r['first_response_s'] for r in sel):.1f} s, "
              f"/health {statistics.median(r['health_s'] for r in sel):.1f} s, load average "
              f"{min(r['load_1m'] for r in sel):.1f}-{max(r['load_1m'] for r in sel):.1f}")
    return rows


if __name__ == "__main__":
    main()
