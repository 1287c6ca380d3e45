#!/usr/bin/env python3
"""MLA decode against GQA decode at the same model width, timed in the same run, as ratios.

MLA (DeepSeek V2/V3) caches one latent row of R + Dr values per token (512 + 64 in DeepSeek V3), shared by
every query head; GQA caches K and V per KV head (2 x kv_heads x head_dim). Both decode one query token
per sequence over a paged cache of `--block-size` blocks in random order, with the same query heads. The
table shows, per batch x context: milliseconds per call of each, the time ratio MLA / GQA, the KV bytes each
reads per cached token, and their ratio (what a bandwidth-bound accelerator would approach).

`--target xla` (the default) times the XLA gather paths (`mla_paged_attention_xla` against
`paged_attention_xla`): what the engine runs on a CPU. There MLA does about 4.5x GQA's multiply-adds per head
and token (it scores and sums R + Dr = 576 columns where a GQA head has 2 x 128) while GQA gathers more bytes
per token, so which one is faster depends on the shape: the table measures it. `--target gpu` times the Pallas
Triton kernels (`mla_paged_attention` against `paged_attention`, compiled on a GPU, interpreted elsewhere: only
meaningful on a GPU).

    python scripts/bench_mla_kernels.py                    # CPU: XLA paths, batch {1, 16} x context {512, 4096}
    python scripts/bench_mla_kernels.py --target gpu       # on a GPU: the kernels
    python scripts/bench_mla_kernels.py --smoke            # tiny sizes, one iteration
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def _time(fn, *args, iters: int) -> float:
    """Median seconds per call over 3 rounds of `iters` back-to-back calls, after 2 warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def _tables(rng, batch: int, context: int, block_size: int):
    """Block tables of `batch` full sequences in random physical blocks, and their lengths."""
    pages = -(-context // block_size)
    tables = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    return jnp.asarray(tables), jnp.full((batch,), context, jnp.int32), batch * pages


def _row(args, batch: int, context: int, dtype) -> dict:
    rng = np.random.default_rng(0)
    tables, lengths, num_blocks = _tables(rng, batch, context, args.block_size)
    key = iter(jax.random.split(jax.random.key(0), 6))
    width = args.rank + args.rope_dim
    kv_pages = jax.random.normal(next(key), (num_blocks, args.block_size, width), dtype)
    q_latent = jax.random.normal(next(key), (batch, args.heads, args.rank), dtype)
    q_rope = jax.random.normal(next(key), (batch, args.heads, args.rope_dim), dtype)
    kv_shape = (args.gqa_kv_heads, num_blocks, args.block_size, args.head_dim)
    k_pages = jax.random.normal(next(key), kv_shape, dtype)
    v_pages = jax.random.normal(next(key), kv_shape, dtype)
    q = jax.random.normal(next(key), (batch, args.heads, args.head_dim), dtype)
    scale = 1.0 / (args.head_dim + args.rope_dim) ** 0.5
    if args.target == "xla":
        mla = jax.jit(functools.partial(pk.mla_paged_attention_xla, scale=scale))
        gqa = jax.jit(pk.paged_attention_xla)
    else:
        mla = jax.jit(functools.partial(pk.mla_paged_attention, scale=scale, target="gpu"))
        gqa = jax.jit(functools.partial(pk.paged_attention, target="gpu"))
    mla_s = _time(mla, q_latent, q_rope, kv_pages, tables, lengths, iters=args.iters)
    gqa_s = _time(gqa, q, k_pages, v_pages, tables, lengths, iters=args.iters)
    itemsize = jnp.dtype(dtype).itemsize
    mla_bytes = width * itemsize
    gqa_bytes = 2 * args.gqa_kv_heads * args.head_dim * itemsize
    return dict(batch=batch, context=context, mla_ms=mla_s * 1e3, gqa_ms=gqa_s * 1e3, mla_bytes=mla_bytes,
                gqa_bytes=gqa_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("xla", "gpu"), default="xla",
                    help="xla: the XLA gather paths (the engine's CPU path); gpu: the Triton kernels")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--heads", type=int, default=16, help="query heads of both (DeepSeek V2-Lite: 16)")
    ap.add_argument("--rank", type=int, default=512, help="MLA kv_lora_rank R")
    ap.add_argument("--rope-dim", type=int, default=64, help="MLA rope dim Dr")
    ap.add_argument("--gqa-kv-heads", type=int, default=4, help="GQA KV heads")
    ap.add_argument("--head-dim", type=int, default=128, help="GQA head_dim (and MLA's qk_nope_head_dim)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one iteration (for tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts, args.iters = [2], [64], 1
    device = jax.devices()[0]
    print(f"# device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, target {args.target}")
    print(f"# {args.dtype}, {args.heads} query heads; MLA R {args.rank} + Dr {args.rope_dim}; GQA "
          f"{args.gqa_kv_heads} KV heads x head_dim {args.head_dim}; block size {args.block_size}")
    print(f"{'batch':>5} {'context':>7} | {'MLA ms':>8} {'GQA ms':>8} {'MLA/GQA':>7} | {'MLA B/tok':>9} "
          f"{'GQA B/tok':>9} {'MLA/GQA':>7}")
    for batch in args.batches:
        for context in args.contexts:
            r = _row(args, batch, context, DTYPES[args.dtype])
            print(f"{r['batch']:>5} {r['context']:>7} | {r['mla_ms']:>8.3f} {r['gqa_ms']:>8.3f} "
                  f"{r['mla_ms'] / r['gqa_ms']:>7.2f} | {r['mla_bytes']:>9} {r['gqa_bytes']:>9} "
                  f"{r['mla_bytes'] / r['gqa_bytes']:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
