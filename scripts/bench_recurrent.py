"""The XLA paths of the recurrent-state layers on this CPU (what the CPU engine runs): tokens per second of a prefill
of 512 tokens (one sequence from position 0) and of a decode step of 16 sequences (one token each, a live state at
position 1000), per layer, at a Qwen3-Next-like linear-attention layer scaled down to a quarter of its heads (4 q/k
heads and 8 v heads of 128; its conv over 2 x 4 x 128 + 8 x 128 = 2048 channels, kernel 4) and a Nemotron-H-like
Mamba-2 mixer likewise (16 heads of 64, 2 groups, state 128). Blocks of 256 tokens; float32 inputs and states; the
pages donated (updated in place), as the engine calls them.

    python scripts/bench_recurrent.py                    # the table
    python scripts/bench_recurrent.py --chunks 8 16 32 64  # prefill tokens/s by chunk_size (the chunked form)
    python scripts/bench_recurrent.py --quick            # seconds: the smoke test

Each time is the best wall time of --repeats runs, and beside it the process's CPU time per run (user + system):
on a machine shared with other work the wall time overstates, and XLA:CPU's threads make the CPU time overstate
an idle machine's wall time by up to its core count.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pallas_kernels as pk  # noqa: E402

BLOCK = 256
GDN = dict(num_k_heads=4, num_v_heads=8, head_k=128, head_v=128)
CONV_CHANNELS, TAPS = 2 * 4 * 128 + 8 * 128, 4
SSD = dict(num_heads=16, head_dim=64, num_groups=2, state_size=128)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, pages, *args, repeats: int) -> tuple[float, float]:
    """(best wall seconds, CPU seconds per run) of `pages = fn(pages, *args)[1]` (compiled first)."""
    pages = jax.block_until_ready(fn(pages, *args))[1]
    best, cpu = float("inf"), 0.0
    for _ in range(repeats):
        start, cpu0 = time.perf_counter(), _cpu()
        pages = jax.block_until_ready(fn(pages, *args))[1]
        best, cpu = min(best, time.perf_counter() - start), cpu + _cpu() - cpu0
    return best, cpu / repeats


def step(mode: str, tokens: int):
    """(block_tables, kv_lens, cu_q_lens, num_blocks): a prefill of `tokens` rows from position 0 (one sequence), or
    a decode step of `tokens` sequences at position 1000."""
    if mode == "prefill":
        tables = np.arange(-(-tokens // BLOCK), dtype=np.int32)[None]
        return jnp.asarray(tables), jnp.asarray([tokens], jnp.int32), jnp.asarray([0, tokens], jnp.int32), \
            tables.size
    per_seq = 1000 // BLOCK + 1
    tables = np.arange(tokens * per_seq, dtype=np.int32).reshape(tokens, per_seq)
    return (jnp.asarray(tables), jnp.full((tokens,), 1001, jnp.int32), jnp.arange(tokens + 1, dtype=jnp.int32),
            tables.size)


def layers(mode: str, tokens: int, chunk_size: int):
    """{name: (fn(pages, *args) -> (out, pages), pages, args)} for the three layers on one step."""
    rng = np.random.default_rng(0)
    tables, kv, cu, num_blocks = step(mode, tokens)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    g = GDN
    gdn_args = (normal(tokens, g["num_k_heads"], g["head_k"]), normal(tokens, g["num_k_heads"], g["head_k"]),
                normal(tokens, g["num_v_heads"], g["head_v"]),
                jnp.asarray(-rng.uniform(0, 2, (tokens, g["num_v_heads"])), jnp.float32),
                jnp.asarray(rng.uniform(0, 1, (tokens, g["num_v_heads"])), jnp.float32))
    s = SSD
    ssd_args = (normal(tokens, s["num_heads"], s["head_dim"]),
                jnp.asarray(rng.uniform(0.01, 0.5, (tokens, s["num_heads"])), jnp.float32),
                jnp.asarray(-rng.uniform(0.5, 4, (s["num_heads"],)), jnp.float32),
                normal(tokens, s["num_groups"], s["state_size"]), normal(tokens, s["num_groups"], s["state_size"]))
    chunked = dict(chunk_size=chunk_size)
    return {
        "gated delta rule": (
            jax.jit(lambda p, q, k, v, gg, b: pk.gated_delta_rule_xla(q, k, v, gg, b, p, tables, kv, cu,
                                                                      block_size=BLOCK, **chunked),
                    donate_argnums=0),
            jnp.zeros((num_blocks, g["num_v_heads"], g["head_k"], g["head_v"]), jnp.float32), gdn_args),
        "conv1d": (
            jax.jit(lambda p, x, w: pk.causal_conv1d_xla(x, w, p, tables, kv, cu, block_size=BLOCK,
                                                         activation="silu"), donate_argnums=0),
            jnp.zeros((num_blocks, CONV_CHANNELS, TAPS - 1), jnp.float32),
            (normal(tokens, CONV_CHANNELS), normal(CONV_CHANNELS, TAPS))),
        "mamba-2 ssd": (
            jax.jit(lambda p, x, dt, a, b, c: pk.mamba2_ssd_xla(x, dt, a, b, c, p, tables, kv, cu, block_size=BLOCK,
                                                                **chunked), donate_argnums=0),
            jnp.zeros((num_blocks, s["num_heads"], s["head_dim"], s["state_size"]), jnp.float32), ssd_args),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=512, help="prefill tokens (one sequence)")
    parser.add_argument("--batch", type=int, default=16, help="decode sequences")
    parser.add_argument("--chunk-size", type=int, default=pk.recurrent.XLA_CHUNK, help="the chunked form's chunk")
    parser.add_argument("--chunks", type=int, nargs="*", help="prefill tokens/s for each of these chunk sizes")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="32-token prefill, batch 4, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefill, args.batch, args.repeats = 32, 4, 2
    rows = []
    if args.chunks:
        print(f"prefill of {args.prefill} tokens by chunk_size: tokens/s (best wall; per CPU second)")
        print("| chunk_size | gated delta rule | mamba-2 ssd |\n|---|---|---|")
        for chunk in args.chunks:
            found = layers("prefill", args.prefill, chunk)
            cells = []
            for name in ("gated delta rule", "mamba-2 ssd"):
                wall, cpu = timed(found[name][0], found[name][1], *found[name][2], repeats=args.repeats)
                rows.append(dict(chunk=chunk, layer=name, wall=wall, cpu=cpu))
                cells.append(f"{args.prefill / wall:,.0f} ({args.prefill / cpu:,.0f})")
            print(f"| {chunk} | " + " | ".join(cells) + " |")
        return rows
    print(f"tokens/s per layer, XLA path (best wall of {args.repeats}; per CPU second in parentheses)")
    print(f"| layer | prefill {args.prefill} | decode batch {args.batch} |\n|---|---|---|")
    results = {mode: layers(mode, n, args.chunk_size) for mode, n in (("prefill", args.prefill),
                                                                      ("decode", args.batch))}
    for name in results["prefill"]:
        cells = []
        for mode, n in (("prefill", args.prefill), ("decode", args.batch)):
            fn, pages, fn_args = results[mode][name]
            wall, cpu = timed(fn, pages, *fn_args, repeats=args.repeats)
            rows.append(dict(layer=name, mode=mode, tokens=n, wall=wall, cpu=cpu))
            cells.append(f"{n / wall:,.0f} ({n / cpu:,.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
