"""Paged decode attention on the CPU: the native kernel (`pagedjax.device.cpu_attention`) against XLA's gather path
(`pallas_kernels.paged_attention_xla`, what the engine ran before), in the same run.

    python scripts/bench_cpu_attention.py                    # the 156M shape's heads, batch 1 / 8 / 16, 1k and 2k
    python scripts/bench_cpu_attention.py --batches 2 --contexts 64 --layers 2 --rounds 1   # seconds (the test's)

Each call attends `--layers` layers in turn, each its own pool holding the batch's contexts in permuted pages, as a
decode step does: the layers' pages together outgrow the CPU's caches, so pages come from memory as in the engine
(where the weights pass through the caches between layers too). Rounds interleave the two paths; medians of the
rounds' best of `--calls` calls, per layer. "GB/s" is the K and V bytes the batch's contexts hold per layer over
that time.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

logger = logging.getLogger("bench_cpu_attention")


def case(dtype: str, batch: int, context: int, layers: int, *, q_heads: int, kv_heads: int, head_dim: int,
         block_size: int):
    """(q, [(k_pages, v_pages)] per layer, block_tables, lengths): `batch` sequences of `context` tokens each, their
    pages permuted through each layer's pool."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    pages = -(-context // block_size)
    blocks = batch * pages + 4
    shape = (kv_heads, blocks, block_size, head_dim)
    pools = [tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))
             for _ in range(layers)]
    q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim), np.float32), dtype)
    tables = jnp.asarray(rng.permutation(blocks)[:batch * pages].reshape(batch, pages), jnp.int32)
    return q, pools, tables, jnp.full((batch,), context, jnp.int32)


def seconds(inputs, path: str, calls: int) -> float:
    """The best of `calls` timed calls (after one that compiles) of every layer's attention by `path`."""
    import jax

    from pagedjax.device.cpu_attention import paged_decode
    from pallas_kernels import paged_attention_xla

    attend = paged_decode if path == "native" else paged_attention_xla
    q, pools, tables, lengths = inputs

    @jax.jit
    def step(q, pools):
        outs = [attend(q, k, v, tables, lengths) for k, v in pools]
        return sum(o.astype("float32") for o in outs)

    step(q, pools).block_until_ready()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        step(q, pools).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / len(pools)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import jax.numpy as jnp

    from pagedjax.device.cpu_attention import status

    if not status().loaded:
        raise SystemExit(f"the native kernel is not loaded: {status().reason}")
    rows = []
    for dtype in args.dtypes:
        for batch in args.batches:
            for context in args.contexts:
                inputs = case(dtype, batch, context, args.layers, q_heads=args.q_heads, kv_heads=args.kv_heads,
                              head_dim=args.head_dim, block_size=args.block_size)
                times: dict[str, list[float]] = {"xla": [], "native": []}
                for _ in range(args.rounds):
                    for path in times:
                        times[path].append(seconds(inputs, path, args.calls))
                xla, nat = (statistics.median(times[path]) for path in ("xla", "native"))
                kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * jnp.dtype(dtype).itemsize
                rows.append(dict(dtype=dtype, batch=batch, context=context, xla_ms=1e3 * xla, native_ms=1e3 * nat,
                                 speedup=xla / nat, native_gbs=kv_bytes / nat / 1e9))
    logger.info("decode attention per layer: %d q / %d KV heads of %d, blocks of %d, %d layers' pools, median of %d "
                "rounds", args.q_heads, args.kv_heads, args.head_dim, args.block_size, args.layers, args.rounds)
    logger.info("| dtype | batch | context | XLA gather ms | native ms | native / XLA speed | native GB/s |")
    logger.info("|---|---|---|---|---|---|---|")
    for r in rows:
        logger.info("| %s | %d | %d | %.3f | %.3f | %.2fx | %.1f |", r["dtype"], r["batch"], r["context"], r["xla_ms"],
                    r["native_ms"], r["speedup"], r["native_gbs"])
    return rows


if __name__ == "__main__":
    main()
