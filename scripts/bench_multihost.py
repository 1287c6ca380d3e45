"""One engine over several processes (`pagedjax.engine.multihost`) against the same layout in one process.

The same tp 4 engine (`ModelConfig()`: 4 layers, hidden 256, 8/2 heads, greedy, 4 fused decode steps) three ways on
this machine's CPU: one process with 4 devices; 2 processes x 2 devices; 4 processes x 1 device (JAX's
distributed runtime, gloo collectives over loopback; process 0 alone is given the requests, the others follow).
A burst of `--batch` requests (`--prompt-len` tokens each, `--max-tokens` out) runs once to compile, then is timed:
generated tokens/s, time to first token (p50 / p99 over the burst, from the burst's start), and the per-step
exchange (process 0's all-gather of the commands and every process's state digest): its count, ms each, bytes
sent. Every layout must give the one-process tokens (checked).

    python scripts/bench_multihost.py            # batch 16, 64 + 32 tokens
    python scripts/bench_multihost.py --quick    # batch 4, 16 + 8 tokens (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 4), (2, 2), (4, 1)]  # (processes, devices per process): tp 4 in all


def worker(rank: int, processes: int, port: int, out: str, args) -> None:
    """One process of a layout: build the engine, run the burst twice (compile, then timed), write the numbers."""
    import numpy as np

    if processes > 1:
        from pagedjax.parallel.distributed import initialize

        initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=rank)
    import jax
    from flax import nnx

    from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
    from pagedjax.engine.multihost import MultiHostEngine, follow
    from pagedjax.model.llama import init_model
    from pagedjax.parallel import ParallelConfig

    cfg = ModelConfig()
    params = jax.tree.map(np.asarray, nnx.split(init_model(cfg, 0))[1])  # each process places its own slices
    engine = LLMEngine(model_config=cfg, params=params, cache_config=CacheConfig(block_size=16, num_blocks=256),
                       scheduler_config=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=512),
                       parallel_config=ParallelConfig(tensor_parallel_size=4), compile_cache=False,
                       decode_steps_per_call=4)
    if rank:
        follow(engine)
        jax.distributed.shutdown()
        return
    lead = MultiHostEngine(engine) if processes > 1 else engine
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    result = {}
    for run in ("compile", "timed"):
        before = (lead.exchanges, lead.exchange_s, lead.bytes_sent) if processes > 1 else (0, 0.0, 0)
        start, first, tokens = time.perf_counter(), {}, {}
        for i, p in enumerate(prompts):
            lead.add_request(f"{run}-{i}", p, greedy)
        while lead.has_unfinished_requests():
            for out_ in lead.step():
                first.setdefault(out_.request_id, time.perf_counter() - start)
                if out_.finished:
                    tokens[out_.request_id] = out_.output_token_ids
        wall = time.perf_counter() - start
        ttft = sorted(first.values())
        after = (lead.exchanges, lead.exchange_s, lead.bytes_sent) if processes > 1 else (0, 0.0, 0)
        result = {"tokens_per_s": args.batch * args.max_tokens / wall, "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
                  "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                  "exchanges": after[0] - before[0], "exchange_ms": 1e3 * (after[1] - before[1]),
                  "bytes": after[2] - before[2], "tokens": [tokens[f"{run}-{i}"] for i in range(args.batch)]}
    Path(out).write_text(json.dumps(result))
    if processes > 1:
        lead.close()
        jax.distributed.shutdown()


def run_layout(processes: int, devices: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        extra = ["--quick"] if args.quick else []
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(processes), str(port),
                                   str(out), *extra], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
                 for rank in range(processes)]
        for p in procs:
            _, err = p.communicate(timeout=1200)
            if p.returncode:
                raise SystemExit(f"layout {processes} x {devices}: a process exited {p.returncode}:\n{err[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 4, 16 + 8 tokens")
    parser.add_argument("--worker", nargs=4, metavar=("RANK", "PROCESSES", "PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch, args.prompt_len, args.max_tokens = (4, 16, 8) if args.quick else (16, 64, 32)
    if args.worker:
        rank, processes, port, out = args.worker
        worker(int(rank), int(processes), int(port), out, args)
        return
    rows = [(p, d, run_layout(p, d, args)) for p, d in LAYOUTS]
    base = rows[0][2]
    print(f"tp 4, batch {args.batch}, {args.prompt_len} + {args.max_tokens} tokens, greedy; CPU devices, gloo "
          "over loopback")
    print(f"{'processes x devices':>20} {'tokens/s':>9} {'vs 1 process':>12} {'TTFT p50 ms':>12} {'p99 ms':>8} "
          f"{'exchanges':>9} {'ms each':>8} {'bytes/step':>10} {'same tokens':>11}")
    for p, d, r in rows:
        each = r["exchange_ms"] / r["exchanges"] if r["exchanges"] else 0.0
        per_step = r["bytes"] / r["exchanges"] if r["exchanges"] else 0
        print(f"{f'{p} x {d}':>20} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:11.2f}x "
              f"{r['ttft_p50_ms']:12.0f} {r['ttft_p99_ms']:8.0f} {r['exchanges']:9d} {each:8.2f} {per_step:10.0f} "
              f"{str(r['tokens'] == base['tokens']):>11}")


if __name__ == "__main__":
    main()
